"""Speculation that switches itself off per row when it does not pay, and back on when it does.

The cost model, in one sentence: a row speculates with γ draft tokens while the tokens it
gains, Leviathan et al.'s expected tokens per block E = (1 - α^(γ+1)) / (1 - α) (2023, Eq. 1;
REFERENCES.md) less the one a plain step gives, exceed its share of what the step costs the
whole batch, R (c - 1) / S: c the measured seconds of a step in which S of the batch's R rows
drafted γ tokens over those of a plain step, α the row's measured acceptance.

Why the batch: a step in which any row drafts costs every row of the batch the draft
forwards and the longer verification. With R rows of which S draft, a plain step yields R
tokens for 1 plain step's seconds, a drafting step (R - S) + Σ_s E_s for c, so it pays only if
Σ_s (E_s - 1) > R (c - 1). Each drafting row takes its 1/S share of the right-hand side: the
sum of the rows' tests is the batch's test when their E are alike, and a row whose E falls
short of its share drops out while the others stay (the step's c then falls, priced by the
next steps). At R = S = 1 this is Leviathan's speedup E / c > 1 (c = γ c_draft + 1): one
request decides as it always has. Measured on 16 concurrent requests of `shakespeare-large`
with the `shakespeare` draft (BENCHMARKS.md): a row alone pays (E ≈ 3 for c ≈ 1.3 when 1-5 of
16 rows draft), while those steps cost the 11-15 plain rows beside it 30 % more each; every
row drafting, c ≈ 3.2 > E.

c holds what a fixed c misses on this engine and machine: the verification's extra rows, the
host's work of a block, a draft forward's cost beside a bare one. So an overhead-bound
target (`shakespeare`: a block of 4 costs about 5 plain steps) never pays, and a memory-bound
one with a cheap draft does. A step is priced from steps that drafted with as many rows and
the nearest draft length (else the nearest number of rows), its extra seconds scaled
linearly in both. The seconds of switching a row back to speculation (its draft model
catching up on the tokens of its plain steps, its target leaving the decode lane:
speculative.py) are paid once per switch and left out of the step's. R and S come from the
engine's step (`StepBatch`): the rows decoding on its lanes (sampling rows too) and the
speculative programs' rows, shared by the programs on one engine (program.py
`ProgramKV.shared`).

A row that does not pay decodes plainly (an empty draft: one target token a step, its
distribution the target's, so the output stays exact whatever the row does) and re-probes
at the next step that is a multiple of its interval (`PROBE_INTERVAL` steps, four times
longer after each probe that does not pay, up to `MAX_PROBE_INTERVAL`: a probe costs the
batch about one block's extra seconds, so over n steps they cost O(log n) until the interval
reaches its cap), so a row whose acceptance rises (a continuation that repeats its prompt, for
prompt lookup) goes back to speculating. A probe is one block of γ draft tokens: it measures
α over up to γ positions and the cost of the very block it decides on (a one-token probe
priced a block by its fixed costs spread over one token, and switched off rows that paid:
`shakespeare-large` with `shakespeare` at 1.3x). On multiples, rows that started together
probe together, and are judged together: S is all of them.

α is accepted / examined draft positions (examined: τ + 1, or γ when all were accepted),
both sums decaying by `DECAY` per block, from a prior of two accepted positions in three
(`PRIOR`). A row is judged by α plus `CONFIDENCE` standard deviations of a rate measured over
all the positions it has examined, sqrt(α (1 - α) / (4 + positions)): wide after a block or
two, gone after a few dozen. These are set by what a wrong choice costs a row: switched off
wrongly it loses its whole speedup until its next probe, 16 or more steps on; speculating a
few blocks too long it loses c - E plain steps a block. With the former decay of 0.5, a prior
of one rejected position and no margin, an unlucky first block switched a row off (a
continuation's first 8 tokens agree with the distilled draft of `shakespeare-large` at 0.47,
the rest at 0.73), and its single probes rarely brought it back: one greedy request of 256
tokens ran at 0.96x plain decoding with the gate against 1.63x without it; now 1.68x
(2026-11-28, BENCHMARKS.md). Replayed on that pair's acceptance position by position (8
held-out prompts) at block costs of 1.3-3.2 plain steps, the gate keeps 0.91-1.0 of the better
of always and never speculating (0.68-0.97 before); on independent acceptances of 0.3-0.9,
0.96-1.0 (0.74-0.99): benchmarks/speculation_gate_replay.py. A drop in acceptance from 0.8
to 0.1 takes about ten blocks to switch a row off (two before). A plain step's seconds are the
least of the last `WINDOW` plain steps (a step after a probe pays for lanes taken again; other
processes only ever add time), and a drafting step's likewise the least of its last `WINDOW`:
the same statistic on both sides of the ratio, which a loaded machine's noise then leaves near
its quiet value (a mean over a least inflated it, and switched off rows that paid).

Since the choice reads the clock, a seeded request at temperature > 0 draws different
uniforms when its rows switch at different steps: its tokens are distributed exactly as the
target's, but the same seed may not give the same tokens twice; so by default such a request
does not fall back (speculative.py `SpeculativeConfig.falls_back`). Greedy output equals
plain greedy decoding whatever the rows do.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

PROBE_INTERVAL = 16  # steps to the first re-probe
MAX_PROBE_INTERVAL = 256
DECAY = 0.9  # weight of the earlier blocks' acceptance at each new block
PRIOR = (2.0, 3.0)  # (accepted, examined) positions before a row's first block: α = 2/3
CONFIDENCE = 1.0  # standard deviations of α's estimate added before judging (module docstring)
WINDOW = 8  # recent steps of a kind (plain; so many rows drafting so many tokens): their least prices it


def pays(alpha: float, gamma: int, step_cost: float, rows: int = 1, drafting: int = 1) -> bool:
    """Whether a row at acceptance α drafting γ tokens pays its share of a step that costs
    `step_cost` plain steps, in which `drafting` of the batch's `rows` rows draft (module
    docstring): E - 1 > R (c - 1) / S. At R = S = 1, Leviathan's speedup E / c > 1."""
    return expected_tokens(alpha, gamma) - 1.0 > rows * (step_cost - 1.0) / drafting


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens a block of γ draft tokens emits on average at acceptance α: (1 - α^(γ+1)) / (1 - α)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclass
class StepCosts:
    """A program's step seconds (module docstring): its recent plain steps (no row of the
    batch drafted), and per (longest draft, rows drafting) its recent steps that drafted."""

    plain: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    drafting: dict = field(default_factory=dict)  # (longest draft, rows drafting) -> deque of seconds

    def record(self, seconds: float, longest_draft: int, drafting: int = 1) -> None:
        if longest_draft == 0:
            self.plain.append(seconds)
        else:
            self.drafting.setdefault((longest_draft, drafting), deque(maxlen=WINDOW)).append(seconds)

    def step_cost(self, gamma: int, drafting: int = 1) -> float | None:
        """A step in which `drafting` rows draft `gamma` tokens, in plain steps (>= 1): from
        the steps measured with as many rows drafting and the nearest length (the longer on a
        tie), else the nearest number of rows, its extra seconds scaled linearly in both;
        None until a plain step and a drafting one are measured."""
        if not self.plain or not self.drafting:
            return None
        length, rows = min(self.drafting, key=lambda k: (abs(k[1] - drafting), abs(k[0] - gamma), -k[0]))
        extra = max(min(self.drafting[length, rows]) / min(self.plain) - 1.0, 0.0)
        return 1.0 + extra * gamma / length * drafting / rows


@dataclass
class StepBatch:
    """One engine step as the speculative programs on that engine see it: R `rows` (those
    decoding on the engine's lanes, with the programs' rows that do not) and S of them
    `drafting`, the `longest` draft. The programs share it (program.py `ProgramKV.shared`):
    every row of theirs joins it after its draft, before the step's forward, and their gates
    read it after, when they settle. The engine runs every program's rounds before any
    program's end of step (rounds.py), so a join after a settle, or a program's second join,
    is the next step's."""

    rows: int = 0
    drafting: int = 0
    longest: int = 0
    joined: set = field(default_factory=set)  # id() of the programs that joined this step
    settled: bool = True

    def join(self, program: object, drafts: list[int], off_lane: int, lanes: int) -> None:
        """A program's rows in the coming step: their draft lengths, how many of them are not
        on a lane, and the engine's lanes now (read at a step's first join)."""
        if self.settled or id(program) in self.joined:
            self.rows, self.drafting, self.longest, self.settled = lanes, 0, 0, False
            self.joined.clear()
        self.joined.add(id(program))
        self.rows += off_lane
        self.drafting += sum(n > 0 for n in drafts)
        self.longest = max([self.longest, *drafts])


@dataclass
class SpeculationGate:
    """One row's choice at every step: how many tokens to draft (0: a plain step)."""

    speculating: bool = False
    interval: int = PROBE_INTERVAL
    next_probe: int = 0  # the step (the caller's count) of the next probe
    probing: bool = False  # this step's block is a probe
    accepted: float = field(default_factory=lambda: PRIOR[0])  # decayed sums (module docstring)
    examined: float = field(default_factory=lambda: PRIOR[1])
    seen: int = 0  # draft positions examined in all, not decayed: how sure α is

    @property
    def alpha(self) -> float:
        return self.accepted / self.examined if self.examined else 0.0

    @property
    def optimistic_alpha(self) -> float:
        """α plus `CONFIDENCE` standard deviations of a rate over the `seen` positions (with
        the prior's, plus one), not the decayed ones (module docstring): the rate a row is
        judged by."""
        alpha = self.alpha
        return min(1.0, alpha + CONFIDENCE * math.sqrt(alpha * (1.0 - alpha) / (PRIOR[1] + 1.0 + self.seen)))

    def draft_tokens(self, gamma: int, costs: StepCosts, step: int) -> int:
        """Step `step`'s draft length: γ while speculating or probing (from `next_probe` on),
        else 0. A row's first steps are plain, until a plain step's cost is measured."""
        if self.speculating:
            return gamma
        if not costs.plain or step < self.next_probe:
            return 0
        self.probing = True
        return gamma

    def settle(self, drafted: int, accepted: int, gamma: int, costs: StepCosts, step: int,
               rows: int = 1, drafting: int = 1) -> None:  # fmt: skip
        """After step `step`'s block drafted `drafted` tokens and kept `accepted`, in a step of
        `rows` rows of which `drafting` drafted: update α and decide whether the next steps
        speculate with γ (`gamma`: the row's next γ)."""
        if drafted == 0:  # nothing to learn; a probe that found no draft (prompt lookup) waits
            if self.probing:
                self.next_probe, self.probing = (step // self.interval + 1) * self.interval, False
            return
        probe, self.probing = self.probing, False
        examined = min(accepted + 1, drafted)
        self.accepted = DECAY * self.accepted + accepted
        self.examined = DECAY * self.examined + examined
        self.seen += examined
        drafting = max(drafting, 1)  # this row drafted
        cost = costs.step_cost(gamma, drafting)
        if cost is None:  # no drafting step measured yet (a row that began speculating)
            self.speculating = False
            return
        if pays(self.optimistic_alpha, gamma, cost, max(rows, drafting), drafting):
            self.speculating = True
            if not probe:  # a block of γ paid, not only a probe's token: probe soon if it stops
                self.interval = PROBE_INTERVAL
        else:
            self.next_probe = (step // self.interval + 1) * self.interval
            self.interval = min(4 * self.interval, MAX_PROBE_INTERVAL)
            self.speculating = False
