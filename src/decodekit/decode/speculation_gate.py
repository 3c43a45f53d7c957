"""Speculation that switches itself off per row when it does not pay, and back on when it does.

The cost model, in one sentence: a row speculates with γ draft tokens while the tokens a
block is expected to emit, (1 - α^(γ+1)) / (1 - α) from the row's measured acceptance α
(Leviathan et al. 2023, Eq. 1; REFERENCES.md), exceed the measured cost of such a block in
plain steps, c(γ) = the seconds of a step that speculated with γ over the seconds of a step
that did not; their ratio is the speedup formula of the same paper, (1 - α^(γ+1)) / ((1 - α)
(γ c + 1)), with the draft and verification costs measured together instead of modelled.

A row that does not pay decodes plainly (an empty draft: one target token a step, its
distribution the target's, so the output stays exact whatever the row does) and re-probes
at the next step that is a multiple of its interval (`PROBE_INTERVAL` steps, doubling after
each probe that does not pay, up to `MAX_PROBE_INTERVAL`), so a row whose acceptance rises (a
continuation that repeats its prompt, for prompt lookup) goes back to speculating. A probe
is one block of `PROBE_DRAFT_TOKENS` draft token: the cheapest block that measures α. On
multiples, rows that started together probe together: in a batch a step with any draft
costs every row the draft forwards, so scattered probes would slow all the plain steps.

α is measured as accepted / examined draft positions (examined: τ + 1, or γ when all were
accepted), both sums decaying by `DECAY` per block so a change of regime shows within a few
blocks, from a prior of one rejected position (a single accepted probe is α = 1/2, not 1).
Costs are step seconds as the program sees them (the whole engine step it waited on), kept
per γ. A γ not yet measured is tried when the row would pay even the largest
measured γ' below it, c(γ') (a lower bound: a block costs more with more draft tokens); the
block that tries it measures c(γ).

Since the choice reads the clock, a seeded request at temperature > 0 draws different
uniforms when its rows switch at different steps: its tokens are distributed exactly as the
target's, but the same seed may not give the same tokens twice (`fallback=False` does).
Greedy output equals plain greedy decoding whatever the rows do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROBE_DRAFT_TOKENS = 1
PROBE_INTERVAL = 8  # plain steps before the first re-probe
MAX_PROBE_INTERVAL = 128
DECAY = 0.5  # weight of the earlier blocks' acceptance at each new block
SMOOTHING = 0.25  # weight of a new step's seconds in the running means


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens a block of γ draft tokens emits on average at acceptance α: (1 - α^(γ+1)) / (1 - α)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclass
class StepCosts:
    """Running means of a program's step seconds: plain steps, and speculative ones per γ
    (the longest draft of the step)."""

    plain: float | None = None
    speculative: dict[int, float] = field(default_factory=dict)

    def record(self, seconds: float, gamma: int) -> None:
        if gamma == 0:
            self.plain = _mean(self.plain, seconds)
        else:
            self.speculative[gamma] = _mean(self.speculative.get(gamma), seconds)

    def block_cost(self, gamma: int) -> float | None:
        """c(γ): a block of γ draft tokens in plain steps, or c(γ') of the largest measured
        γ' < γ (a lower bound), or None before a plain step and a speculative one are measured."""
        below = [g for g in self.speculative if g <= gamma]
        if self.plain is None or not below:
            return None
        return self.speculative[max(below)] / self.plain


def _mean(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


@dataclass
class SpeculationGate:
    """One row's choice at every step: how many tokens to draft (0: a plain step)."""

    speculating: bool = False
    interval: int = PROBE_INTERVAL
    next_probe: int = 0  # the step (the caller's count) of the next probe
    accepted: float = 0.0  # decayed sums (module docstring)
    examined: float = 1.0

    @property
    def alpha(self) -> float:
        return self.accepted / self.examined if self.examined else 0.0

    def draft_tokens(self, gamma: int, costs: StepCosts, step: int) -> int:
        """Step `step`'s draft length: γ while speculating, a probe's from `next_probe` on,
        else 0. A row's first steps are plain, until a plain step's cost is measured."""
        if self.speculating:
            return gamma
        if costs.plain is None or step < self.next_probe:
            return 0
        return min(PROBE_DRAFT_TOKENS, gamma)

    def settle(self, drafted: int, accepted: int, gamma: int, costs: StepCosts, step: int) -> None:
        """After step `step`'s block drafted `drafted` tokens and kept `accepted`: update α and
        decide whether the next steps speculate with γ (`gamma`: the row's next γ)."""
        if drafted == 0:
            return
        examined = min(accepted + 1, drafted)
        self.accepted = DECAY * self.accepted + accepted
        self.examined = DECAY * self.examined + examined
        cost = costs.block_cost(gamma)
        if cost is None:  # only the probe's γ is measured: the next block measures γ itself
            self.speculating = True
            return
        pays = expected_tokens(self.alpha, gamma) > cost
        if pays:
            self.speculating, self.interval = True, PROBE_INTERVAL
        else:
            self.next_probe = (step // self.interval + 1) * self.interval
            self.interval = min(2 * self.interval, MAX_PROBE_INTERVAL)
            self.speculating = False
