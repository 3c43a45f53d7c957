"""What every meta-generator returns: the chosen output, every candidate, and the spend."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from decodekit.completion import Completion


@dataclass
class Candidate:
    """One output a strategy considered.

    `score` is the scorer's value (None when unscored or when the scorer failed, in which
    case `error` says why); `answer` is what the answer extractor read (None when it found
    none). Tree search fills `steps` and `step_scores` (one process reward per step).
    """

    text: str
    completion: Completion | None = field(default=None, repr=False)
    score: float | None = None
    answer: Hashable | None = None
    error: str | None = None
    steps: list[str] | None = None
    step_scores: list[float] | None = None
    note: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


@dataclass
class MetaResult:
    """The chosen candidate (None if there was none to choose), all candidates in the order
    they were produced, the chosen answer, per-answer tallies or expected utilities where the
    strategy computes them, and the budget report (Budget.report())."""

    strategy: str
    chosen: Candidate | None
    candidates: list[Candidate]
    budget: dict
    answer: Hashable | None = None
    tallies: dict = field(default_factory=dict)
    stopped_by_budget: bool = False

    @property
    def text(self) -> str | None:
        return self.chosen.text if self.chosen is not None else None
