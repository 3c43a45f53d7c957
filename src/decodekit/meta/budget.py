"""Compute accounting for meta-generators (seed 001: compare strategies at equal budget).

A `Budget` counts what a strategy spent and, when given limits, says when to stop.
Generators and scorers report into it; meta-generators check `exhausted` between
rounds (they never cut a generator call in half).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

LIMIT_FIELDS = ("generator_calls", "generated_tokens", "scorer_calls", "wall_time")


@dataclass
class Budget:
    """Counters of spent compute, with optional limits (None = unlimited)."""

    generator_calls: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    reused_prefix_tokens: int = 0
    scorer_calls: int = 0
    limits: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        for name, value in self.limits.items():
            if name not in LIMIT_FIELDS:
                raise ValueError(f"budget limit {name!r} is not one of {LIMIT_FIELDS}")
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"budget limit {name} must be a positive number, got {value!r}")

    @property
    def wall_time(self) -> float:
        return time.perf_counter() - self.started

    @property
    def exhausted(self) -> bool:
        return any(getattr(self, name) >= limit for name, limit in self.limits.items())

    def add_generation(self, prompt_tokens: int, generated_tokens: int, reused: int = 0) -> None:
        self.generator_calls += 1
        self.prompt_tokens += prompt_tokens
        self.generated_tokens += generated_tokens
        self.reused_prefix_tokens += reused

    def add_scorer_calls(self, count: int = 1) -> None:
        self.scorer_calls += count

    def report(self) -> dict:
        counts = asdict(self)
        counts.pop("started")
        counts.pop("limits")
        counts["wall_time"] = round(self.wall_time, 4)
        return counts
