"""Compute accounting for meta-generators (seed 001: compare strategies at equal budget).

A `Budget` counts what a strategy spent and, when given limits, says when to stop.
Generators and scorers report into it; meta-generators check `exhausted` between
rounds (they never cut a generator call in half, so a limit can be overshot by at most
one round).

Counters:
- generator_calls       requests sent to a generator: one per prompt per `generate` call
                        (the n samples of a prompt are one request);
- prompt_tokens         prompt tokens the generator computed (prefilled);
- generated_tokens      tokens sampled, stop and EOS tokens included;
- reused_prefix_tokens  prompt tokens not recomputed because a prefix was shared
                        (prompt_tokens + reused = what n independent requests would send);
- scorer_calls          calls of a reward model, verifier, utility or feedback function;
- tool_calls            calls of a tool between generation steps (a calculator);
- wall_time             seconds since the budget was created.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

COUNTERS = (
    "generator_calls", "prompt_tokens", "generated_tokens", "reused_prefix_tokens", "scorer_calls",
    "tool_calls",
)
LIMIT_FIELDS = (
    "generator_calls", "prompt_tokens", "generated_tokens", "scorer_calls", "tool_calls", "wall_time",
)


@dataclass
class Budget:
    """Counters of spent compute, with optional limits (absent = unlimited)."""

    generator_calls: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    reused_prefix_tokens: int = 0
    scorer_calls: int = 0
    tool_calls: int = 0
    limits: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        for name, value in self.limits.items():
            if name not in LIMIT_FIELDS:
                raise ValueError(f"budget limit {name!r} is not one of {LIMIT_FIELDS}")
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"budget limit {name} must be a positive number, got {value!r}")

    @property
    def wall_time(self) -> float:
        return time.perf_counter() - self.started

    @property
    def exhausted(self) -> bool:
        return any(getattr(self, name) >= limit for name, limit in self.limits.items())

    def add_generation(self, prompt_tokens: int, generated_tokens: int, reused: int = 0) -> None:
        """One request: `prompt_tokens` computed, `generated_tokens` sampled, `reused` shared."""
        self.generator_calls += 1
        self.prompt_tokens += prompt_tokens
        self.generated_tokens += generated_tokens
        self.reused_prefix_tokens += reused

    def add_scorer_calls(self, count: int = 1) -> None:
        self.scorer_calls += count

    def counts(self) -> dict[str, int]:
        """The integer counters (no wall time): a snapshot to diff against later."""
        return {name: getattr(self, name) for name in COUNTERS}

    def add_counts(self, counts: dict[str, int]) -> None:
        for name, value in counts.items():
            setattr(self, name, getattr(self, name) + value)

    def since(self, snapshot: dict[str, int]) -> dict[str, int]:
        """What was spent after `snapshot` (a `counts()` taken earlier)."""
        return {name: getattr(self, name) - snapshot[name] for name in COUNTERS}

    def report(self) -> dict:
        counts: dict = self.counts()
        counts["wall_time"] = round(self.wall_time, 4)
        if self.limits:
            counts["limits"] = dict(self.limits)
            counts["exhausted"] = self.exhausted
        return counts
