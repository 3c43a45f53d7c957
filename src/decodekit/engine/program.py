"""Programs: decoding strategies that choose their own tokens, run on the engine.

A sampling request (request.py) gets one token per row per step from its chain and
selector. Beam search, speculative and contrastive decoding decide otherwise: beams are
selected and forked, draft tokens are verified and the rejected ones cropped, an expert's
logits are combined with an amateur's. Each is a `Program`, whose `step(kv)` is a
generator: at every engine step it yields the forwards it needs and receives their logits,

    def step(self, kv):
        [draft] = yield [Forward(self.draft, feeds)]      # a member model: batched with the
        ...                                               # other programs' feeds to it
        [target] = yield [Forward(kv.model, feeds)]       # the engine's model: joins the
        ...                                               # step's one forward
        return deltas                                     # and the step ends

The engine (engine.py, rounds.py) drives every running program in lockstep: the member
forwards of all programs run batched, one forward per model per round, until each waits on
the engine's model (or ended its step); then their feeds join the step's single forward,
beside the sampling rows. Sixteen concurrent beam searches cost one forward per step,
not sixteen, and speculative requests draft together and verify together.

KV: a program's sequences (`Seq`) live in the engine's block pool (its model's) or in a
member pool (one per other model, same block size, built on first use), with the table
operations of block_pool.py through `ProgramKV`: `open` (a table that starts from the prefix
cache), `fork` (full blocks shared, copy-on-write), `crop`, `close` (the KV stays in the
prefix cache). A `Feed` computes every token of its sequence not yet in its table and
returns the logits of the last one, or of every one (`every`: verification). A sequence
of the engine's model that feeds exactly one token at every step may take a `RunningKV`
lane (`Feed(lane=True)`), so it decodes over dense rows like a sampling row, and may have
the engine sample its token (`Feed(row=...)`), batched with the others like a sampling
row's (speculative rows that decode plainly: decode/speculation_gate.py).

Memory: a program declares its worst case per model (`needs`); it is admitted when that
fits, and the part of it not yet allocated is held from the scheduler (`BlockPool.held`),
so a program never runs out of blocks and is never preempted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator
from dataclasses import dataclass, field

import torch

from decodekit.engine.block_pool import BlockTable
from decodekit.engine.members import ModelKV
from decodekit.models.base import LanguageModel
from decodekit.request import Delta, Row


@dataclass(eq=False)
class Seq:
    """A sequence on the engine, a sampling request's sample or a program's: its tokens
    (computed or about to be), its KV table and pool."""

    tokens: list[int]
    table: BlockTable
    model_kv: ModelKV  # its model's KV on the engine (members.py)
    lane: int | None = None  # its RunningKV row (the engine's model only)
    row: Row | None = None  # a sampling request's: the row its tokens are sampled for

    @property
    def model(self) -> LanguageModel:
        return self.model_kv.model

    @property
    def pending(self) -> int:
        """Tokens not yet computed: the next feed's count."""
        return len(self.tokens) - self.table.length


@dataclass(eq=False)
class Feed:
    seq: Seq
    every: bool = False  # logits of every new position, else of the last one
    lane: bool = False  # take a RunningKV lane after this forward (one token a step from now on)
    # Sample this row's next token from the feed's logits as the engine samples a sampling
    # request's, batched with the step's other such rows (request.py `sample_rows`): a program's
    # row that decodes plainly. Its request has one row, whose state accepts the token.
    row: Row | None = None


@dataclass
class Forward:
    model: LanguageModel
    feeds: list[Feed]


# What a program's step yields (the forwards it needs now) and is sent back (per forward,
# per feed, logits [k, V] float32 with k = the feed's count if `every`, else 1).
StepGenerator = Generator[list[Forward], list[list[torch.Tensor]], list[Delta]]


class Program(ABC):
    """A request decided by its own strategy. Subclasses set `prompt_index`, `num_samples`."""

    prompt_index: int = 0
    num_samples: int = 1

    @abstractmethod
    def needs(self, block_size: int) -> list[tuple[LanguageModel, int]]:
        """The most KV blocks it can hold at once, per model."""

    @abstractmethod
    def step(self, kv: ProgramKV) -> StepGenerator:
        """One engine step (module docstring). Set `finished` when its last delta is out."""

    finished: bool = False

    def cancel(self) -> list[Delta]:
        """Final deltas of the samples not yet delivered, when it is cancelled mid-way."""
        return []


@dataclass(eq=False)
class ProgramKV:
    """A program's handle on the engine's KV (module docstring); tracks its sequences."""

    model: LanguageModel  # the engine's model
    members: object  # callable: model -> ModelKV (the engine's `Members.of`)
    seqs: list[Seq] = field(default_factory=list)

    @property
    def shared(self) -> dict:
        """State the programs on this engine share, under keys of their own (the speculative
        programs' view of each step: decode/speculation_gate.py `StepBatch`). It lives as long
        as the engine's pool."""
        return self.members(self.model).shared

    def lanes(self) -> int:
        """Sequences decoding on the engine's RunningKV lanes now: its sampling rows and the
        programs' rows that feed one token a step."""
        return len(self.members(self.model).running_kv)

    def open(self, model: LanguageModel, tokens: list[int]) -> Seq:
        """A sequence of `tokens`, its table starting with their cached prefix."""
        model_kv = self.members(model)
        seq = Seq(list(tokens), model_kv.manager.new_table(tokens), model_kv)
        self.seqs.append(seq)
        return seq

    def fork(self, seq: Seq) -> Seq:
        """A copy of `seq` (tokens, KV and lane) that can grow apart from it."""
        model_kv = seq.model_kv
        if seq.pending:  # a raise, not an assert: a program's misuse ends that program (rounds.py)
            raise ValueError(f"fork a sequence once its tokens are computed ({seq.pending} pending)")
        child = Seq(list(seq.tokens), model_kv.manager.fork(seq.table), model_kv)
        if seq.lane is not None:
            child.lane = model_kv.running_kv.copy(child, seq.lane)
        self.seqs.append(child)
        return child

    def crop(self, seq: Seq, length: int) -> None:
        """Keep the first `length` tokens (and their KV)."""
        if seq.lane is not None:
            raise ValueError("a sequence with a lane cannot crop: `leave_lane` first")
        seq.model_kv.manager.crop(seq.table, min(length, seq.table.length))
        del seq.tokens[length:]

    def leave_lane(self, seq: Seq) -> None:
        """Give up the sequence's RunningKV lane, if it has one: its KV stays in its blocks,
        and it may feed several tokens or crop again."""
        if seq.lane is not None:
            seq.model_kv.running_kv.leave(seq)

    def close(self, seq: Seq) -> None:
        """Free the sequence; its computed KV stays findable in the prefix cache."""
        seq.model_kv.close(seq)
        self.seqs.remove(seq)

    def close_all(self) -> None:
        for seq in list(self.seqs):
            self.close(seq)

    def blocks_used(self, model_kv: ModelKV) -> int:
        return len({b for seq in self.seqs if seq.model_kv is model_kv for b in seq.table.blocks})
