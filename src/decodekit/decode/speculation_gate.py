"""Speculation that switches itself off per row when it does not pay, and back on when it does.

The cost model, in one sentence: a row speculates with γ draft tokens while Leviathan et
al.'s expected tokens per block, (1 - α^(γ+1)) / (1 - α) (2023, Eq. 1; REFERENCES.md),
exceed the measured seconds of a step that drafts γ tokens over those of a plain step, with
α the row's measured acceptance. Leviathan's speedup divides by γ c + 1 (c: a draft token's
cost in target steps); the measured step holds that and what a fixed c misses on this engine
and machine: the verification's extra rows, the host's work of a block, a draft forward's
cost beside a bare one. So an overhead-bound target (`shakespeare`: a block of 4 costs about
5 plain steps) never pays, and a memory-bound one with a cheap draft does. A step drafting a
length not measured yet is priced from the nearest measured length, its extra seconds scaled
linearly. The seconds of switching a row back to speculation (its draft model catching up on
the tokens of its plain steps, its target leaving the decode lane: speculative.py) are paid
once per switch and left out of the step's.

A row that does not pay decodes plainly (an empty draft: one target token a step, its
distribution the target's, so the output stays exact whatever the row does) and re-probes
at the next step that is a multiple of its interval (`PROBE_INTERVAL` steps, four times
longer after each probe that does not pay, up to `MAX_PROBE_INTERVAL`: a probe costs the
batch about one block's extra seconds, so over n steps they cost O(log n)), so a row whose
acceptance rises (a continuation that repeats its prompt, for prompt lookup) goes back to
speculating. A probe is one block of γ draft tokens: it measures α over up to γ positions and
the cost of the very block it decides on (a one-token probe priced a block by its fixed
costs spread over one token, and switched off rows that paid: `shakespeare-large` with
`shakespeare` at 1.3x). On multiples, rows that started together probe together: in a batch
a step with any draft costs every row the draft forwards, so scattered probes would slow all
the plain steps.

α is accepted / examined draft positions (examined: τ + 1, or γ when all were accepted),
both sums decaying by `DECAY` per block so a change of regime shows within a few blocks, from
a prior of one rejected position (a single accepted draft token is α = 1/2, not 1). A plain
step's seconds are the least of the last `WINDOW` plain steps (a step after a probe pays
for lanes taken again; other processes only ever add time), and a step drafting γ tokens
likewise the least of its last `WINDOW`: the same statistic on both sides of the ratio, which
a loaded machine's noise then leaves near its quiet value (a mean over a least inflated it,
and switched off rows that paid).

Since the choice reads the clock, a seeded request at temperature > 0 draws different
uniforms when its rows switch at different steps: its tokens are distributed exactly as the
target's, but the same seed may not give the same tokens twice; so by default such a request
does not fall back (speculative.py `SpeculativeConfig.falls_back`). Greedy output equals
plain greedy decoding whatever the rows do.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

PROBE_INTERVAL = 16  # steps to the first re-probe
MAX_PROBE_INTERVAL = 256
DECAY = 0.5  # weight of the earlier blocks' acceptance at each new block
WINDOW = 8  # recent steps of a kind (plain, or drafting so many tokens) whose least seconds price it


def speedup(alpha: float, gamma: int, step_cost: float) -> float:
    """The expected speedup of blocks of γ at acceptance α whose step costs `step_cost` plain
    steps: Leviathan et al.'s (1 - α^(γ+1)) / ((1 - α)(γ c + 1)) where step_cost = γ c + 1."""
    return expected_tokens(alpha, gamma) / step_cost


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens a block of γ draft tokens emits on average at acceptance α: (1 - α^(γ+1)) / (1 - α)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclass
class StepCosts:
    """A program's step seconds (module docstring): its recent plain steps, and per longest
    draft length its recent steps that drafted that many tokens."""

    plain: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    drafting: dict = field(default_factory=dict)  # longest draft -> deque of seconds

    def record(self, seconds: float, longest_draft: int) -> None:
        if longest_draft == 0:
            self.plain.append(seconds)
        else:
            self.drafting.setdefault(longest_draft, deque(maxlen=WINDOW)).append(seconds)

    def step_cost(self, gamma: int) -> float | None:
        """A step drafting `gamma` tokens in plain steps (>= 1), from the nearest measured
        draft length (the longer on a tie), its extra seconds scaled by gamma / length; None
        until a plain step and a drafting one are measured."""
        if not self.plain or not self.drafting:
            return None
        length = min(self.drafting, key=lambda n: (abs(n - gamma), -n))
        extra = max(min(self.drafting[length]) / min(self.plain) - 1.0, 0.0)
        return 1.0 + extra * gamma / length


@dataclass
class SpeculationGate:
    """One row's choice at every step: how many tokens to draft (0: a plain step)."""

    speculating: bool = False
    interval: int = PROBE_INTERVAL
    next_probe: int = 0  # the step (the caller's count) of the next probe
    probing: bool = False  # this step's block is a probe
    accepted: float = 0.0  # decayed sums (module docstring)
    examined: float = 1.0

    @property
    def alpha(self) -> float:
        return self.accepted / self.examined if self.examined else 0.0

    def draft_tokens(self, gamma: int, costs: StepCosts, step: int) -> int:
        """Step `step`'s draft length: γ while speculating or probing (from `next_probe` on),
        else 0. A row's first steps are plain, until a plain step's cost is measured."""
        if self.speculating:
            return gamma
        if not costs.plain or step < self.next_probe:
            return 0
        self.probing = True
        return gamma

    def settle(self, drafted: int, accepted: int, gamma: int, costs: StepCosts, step: int) -> None:
        """After step `step`'s block drafted `drafted` tokens and kept `accepted`: update α and
        decide whether the next steps speculate with γ (`gamma`: the row's next γ)."""
        if drafted == 0:  # nothing to learn; a probe that found no draft (prompt lookup) waits
            if self.probing:
                self.next_probe, self.probing = (step // self.interval + 1) * self.interval, False
            return
        probe, self.probing = self.probing, False
        examined = min(accepted + 1, drafted)
        self.accepted = DECAY * self.accepted + accepted
        self.examined = DECAY * self.examined + examined
        cost = costs.step_cost(gamma)
        if cost is None:  # no drafting step measured yet (a row that began speculating)
            self.speculating = False
            return
        if speedup(self.alpha, gamma, cost) > 1.0:
            self.speculating = True
            if not probe:  # a block of γ paid, not only a probe's token: probe soon if it stops
                self.interval = PROBE_INTERVAL
        else:
            self.next_probe = (step // self.interval + 1) * self.interval
            self.interval = min(4 * self.interval, MAX_PROBE_INTERVAL)
            self.speculating = False
