"""Speculation that switches itself off per row when it does not pay, and back on when it does.

The cost model, in one sentence: a row speculates with γ draft tokens while Leviathan et
al.'s speedup (1 - α^(γ+1)) / ((1 - α)(γ c + 1)) exceeds 1 (2023, Eq. 1 and Theorem 3.8;
REFERENCES.md), with α the row's measured acceptance and c the measured cost of one draft
token in plain steps: the seconds of a step whose blocks drafted one token, over those of a
plain step, less one. c so measured holds everything a draft token costs on this engine and
this machine: the draft forward, the verified position, leaving the decode lane, the host's
work; an overhead-bound target (`shakespeare`: c near 1) never pays, a memory-bound one with
a cheap draft does.

A row that does not pay decodes plainly (an empty draft: one target token a step, its
distribution the target's, so the output stays exact whatever the row does) and re-probes
at the next step that is a multiple of its interval (`PROBE_INTERVAL` steps, four times
longer after each probe that does not pay, up to `MAX_PROBE_INTERVAL`: a probe costs the
batch about c + 1 plain steps, so over n steps they cost O(log n)), so a row whose acceptance rises (a
continuation that repeats its prompt, for prompt lookup) goes back to speculating. A probe
is one block of one draft token, the cheapest that measures α and c. On multiples, rows that
started together probe together: in a batch a step with any draft costs every row the draft
forwards, so scattered probes would slow all the plain steps, and c is measured on steps
where the batch probes as a whole.

α is accepted / examined draft positions (examined: τ + 1, or γ when all were accepted),
both sums decaying by `DECAY` per block so a change of regime shows within a few blocks, from
a prior of one rejected position (a single accepted probe is α = 1/2, not 1). A plain step's
seconds are the least of the last `PLAIN_WINDOW` plain steps (a step after a probe pays for
lanes taken again; other processes only ever add time); a probe's are a running mean.

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
PLAIN_WINDOW = 8  # plain steps whose least seconds price a plain step
SMOOTHING = 0.25  # weight of a new probe's seconds in their running mean


def speedup(alpha: float, gamma: int, cost: float) -> float:
    """Leviathan et al.'s expected speedup: (1 - α^(γ+1)) / ((1 - α)(γ c + 1))."""
    return expected_tokens(alpha, gamma) / (gamma * cost + 1.0)


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens a block of γ draft tokens emits on average at acceptance α: (1 - α^(γ+1)) / (1 - α)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclass
class StepCosts:
    """A program's step seconds (module docstring): its recent plain steps, and the running
    mean of its steps whose longest draft was one token."""

    plain: deque = field(default_factory=lambda: deque(maxlen=PLAIN_WINDOW))
    probe: float | None = None

    def record(self, seconds: float, longest_draft: int) -> None:
        if longest_draft == 0:
            self.plain.append(seconds)
        elif longest_draft == 1:
            self.probe = seconds if self.probe is None else (1 - SMOOTHING) * self.probe + SMOOTHING * seconds

    def draft_token_cost(self) -> float | None:
        """c: one draft token in plain steps, None until a plain step and a probe are measured."""
        if not self.plain or self.probe is None:
            return None
        return max(self.probe / min(self.plain) - 1.0, 0.0)


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
        """Step `step`'s draft length: γ while speculating, a probe's (1) from `next_probe` on,
        else 0. A row's first steps are plain, until a plain step's cost is measured."""
        if self.speculating:
            return gamma
        if not costs.plain or step < self.next_probe:
            return 0
        self.probing = True
        return 1

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
        cost = costs.draft_token_cost()
        if cost is None:  # no probe measured yet (a row that began speculating): measure one
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
