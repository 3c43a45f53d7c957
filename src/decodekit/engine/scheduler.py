"""Continuous batching: which requests run in the next step, and their KV slots.

One kind of entry (`Entry`) for every request the engine runs: a sampling request
(request.py: each row gets one token per step from its own chain) or a program (program.py:
beam search, speculative and contrastive decoding, which choose their own tokens). Both
wait in one queue, in arrival order, run from one list, oldest first, and are admitted by
one rule. Each step (Orca, Yu et al. 2022; vLLM's and nano-vllm's scheduler):

1. every running sampling sequence decodes one token: its slot is reserved, oldest entry
   first; when the pool runs dry the youngest running sampling request is preempted (its
   blocks freed, their KV left in the prefix cache, its generated tokens kept) and goes
   back to the front of the queue. Programs reserve their own slots as they feed, from
   what they hold (rule below);
2. waiting entries are admitted in arrival order while sequences, prompt tokens and blocks
   allow. A new sampling request prefills its prompt once, as one sequence, reusing any
   cached prefix; its other n - 1 samples are forked from it after the forward. A
   preempted request recomputes each sample's prompt + generated tokens (most of it found
   in the prefix cache).

The admission rule: an entry starts when the blocks it must hold fit the pool's available
blocks, which exclude what running entries hold. What an entry holds is the part of its
need it cannot give back at a step boundary: nothing for a sampling request (its next
token's slot is reserved each step, and it can be preempted and recomputed between
steps), its worst case for a program (`Program.needs`): a program's step is a generator
that cannot be undone halfway, so it must never run out of blocks; it is never preempted.

All samples of a request run in the same steps, so a request's rows stay together and
its `SamplerState` rows line up with them (request.py). An entry is admitted only if it
fits the pool alone, so the oldest can always finish.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from decodekit.engine.config import EngineConfig
from decodekit.engine.kv import BlockTable
from decodekit.engine.program import Forward, Member, Program, ProgramKV, Seq
from decodekit.models.base import LanguageModel
from decodekit.request import Delta, Request, Row, cancel_rows


@dataclass(eq=False)
class Entry:
    """A queued or running request: a sampling `request` or a `program` (exactly one)."""

    request: Request | None = None
    program: Program | None = None
    handle: Any = None  # engine.RequestHandle
    seqs: list[Seq] = field(default_factory=list)  # live sequences (a request's in row order)
    kv: ProgramKV | None = None  # a program's handle on the KV, tracking `seqs`
    models: list[LanguageModel] = field(default_factory=list)  # whose KV it uses besides ours
    needs: list[tuple[Member, int]] = field(default_factory=list)  # held worst case, per pool
    started: bool = False  # admitted at least once (a preempted request recomputes)
    cancelled: bool = False
    # A program's step in progress (engine.py): its generator, the forwards it waits on and
    # their logits so far.
    generator: Any = None
    forwards: list[Forward] = field(default_factory=list)
    results: list[list[Any]] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        return self.program.num_samples if self.program is not None else len(self.request.rows)

    def blocks_alone(self, model: LanguageModel, block_size: int) -> int:
        """Blocks of `model` it needs at most with nothing else running."""
        if self.program is not None:
            return sum(n for m, n in self.program.needs(block_size) if m is model)
        return blocks_alone(self.request, block_size)

    def finals(self) -> list[Delta]:
        """The deltas that end its unfinished samples when it is cancelled."""
        return self.program.cancel() if self.program is not None else cancel_rows(self.request.rows)


def entry_for(item: Request | Program) -> Entry:
    """The entry of a sampling request or a program."""
    return Entry(program=item) if isinstance(item, Program) else Entry(request=item)


@dataclass
class Work:
    """A sequence's part of the step: `count` new tokens written at `slots`."""

    seq: Seq
    count: int
    slots: list[int]
    every: bool = False  # keep the logits of every new token (a program's verification)


@dataclass
class Step:
    work: list[Work] = field(default_factory=list)  # sampling sequences, a request's together
    rows: list[Row] = field(default_factory=list)  # the rows that receive a token, in logits order
    logit_rows: list[int] = field(default_factory=list)  # for each row, its index into the kept logits
    forks: list[Entry] = field(default_factory=list)  # fresh requests whose samples 1..n-1 fork sample 0
    programs: list[Entry] = field(default_factory=list)  # the running programs, oldest first


def blocks_alone(request: Request, block_size: int) -> int:
    """Blocks a request needs at most with nothing else running (prompt blocks shared)."""
    prompt = len(request.prompt_ids)
    longest = prompt + request.params.max_new_tokens
    per_sample = -(-longest // block_size) - prompt // block_size
    return prompt // block_size + request.params.n * per_sample


class Scheduler:
    """members: the engine's KV per model (id -> Member), its own model's `main` among them;
    member: model -> Member, building a pool on first use (`Engine.member`)."""

    def __init__(
        self,
        main: Member,
        members: dict[int, Member],
        member: Callable[[LanguageModel], Member],
        config: EngineConfig,
    ):
        self.main = main
        self.members = members
        self.member = member
        self.config = config
        self.waiting: deque[Entry] = deque()
        self.running: list[Entry] = []  # oldest first
        self.prefill_tokens = 0  # prompt (and recomputed) tokens computed
        self.cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.preemptions = 0

    @property
    def manager(self):
        return self.main.manager

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, entry: Entry) -> None:
        """Drop an entry (finished, cancelled or failed) and free its blocks; what it
        computed stays in the prefix cache."""
        for seq in entry.seqs:
            seq.member.close(seq)
        entry.seqs.clear()
        if entry in self.running:
            self.running.remove(entry)
        elif entry in self.waiting:
            self.waiting.remove(entry)
        if entry.needs:
            self.hold()  # what it held is free again

    def hold(self) -> None:
        """Hold, in each pool, the blocks running programs may still allocate."""
        held = dict.fromkeys(self.members, 0)
        for entry in self.running:
            for member, needed in entry.needs:
                held[id(member.model)] += max(0, needed - entry.kv.blocks_used(member))
        for key, member in self.members.items():
            member.pool.held = held[key]

    def schedule(self) -> Step:
        step = Step()
        for entry in list(self.running):
            if entry not in self.running or entry.program is not None:
                continue  # preempted making room for an older one; a program feeds itself
            # Reserved at once, so the next request's room counts these blocks as taken; a
            # request's victims are always younger than it, so no reserved one is preempted.
            if self._make_room(entry, sum(self.manager.blocks_needed(s.table, 1) for s in entry.seqs)):
                for seq in entry.seqs:
                    self._add(step, seq, 1, [seq.row])
        self._admit(step)
        step.programs = [entry for entry in self.running if entry.program is not None]
        return step

    def _admit(self, step: Step) -> None:
        budget = self.config.max_prefill_tokens
        live = sum(len(e.seqs) for e in self.running)
        while self.waiting:
            entry = self.waiting[0]
            samples = len(entry.seqs) if entry.started else entry.num_samples
            if live + samples > self.config.max_running and self.running:
                return
            if entry.program is not None:
                admitted = self._admit_program(entry)
            else:
                admitted = self._admit_request(entry, step, budget)
            if admitted is None:
                return
            self.waiting.popleft()
            self.running.append(entry)
            entry.started = True
            budget -= admitted
            live += samples

    def _admit_program(self, entry: Entry) -> int | None:
        """Hold a program's worst case if it fits (None if not); it computes nothing now."""
        needs = [(self.member(model), n) for model, n in entry.program.needs(self.config.block_size)]
        if any(needed > member.pool.num_available for member, needed in needs):
            return None
        entry.needs = needs
        for member, needed in needs:
            member.pool.held += needed
        return 0

    def _admit_request(self, entry: Entry, step: Step, budget: int) -> int | None:
        """Prefill a sampling request's sequences if their blocks and the prompt budget
        allow: its prompt tokens computed, or None."""
        fresh = not entry.started
        if fresh:
            tokens = list(entry.request.prompt_ids)
            entry.seqs = [Seq(tokens, BlockTable(), self.main, row=entry.request.rows[0])]
        seqs = entry.seqs
        tables = [self.manager.new_table(seq.tokens) for seq in seqs]
        counts = [len(seq.tokens) - t.length for seq, t in zip(seqs, tables)]
        size = self.manager.block_size
        forks = len(entry.request.rows) - 1 if fresh and len(seqs[0].tokens) % size else 0
        needed = sum(self.manager.blocks_needed(t, c) for t, c in zip(tables, counts)) + forks
        over_budget = sum(counts) > budget and budget < self.config.max_prefill_tokens
        if over_budget or needed > self.main.pool.num_available:
            for table in tables:
                self.manager.free(table)  # back to the cache's idle list
            return None
        self.prefill_tokens += sum(counts)
        self.cached_tokens += sum(t.length for t in tables)
        if fresh:
            entry.request.cached_prompt_tokens = tables[0].length
        for seq, table, count in zip(seqs, tables, counts):
            seq.table = table
            # n samples of a fresh prompt all read its one row of logits
            rows = entry.request.rows if fresh else [seq.row]
            self._add(step, seq, count, rows)
        if fresh and len(entry.request.rows) > 1:
            step.forks.append(entry)
        return sum(counts)

    def _add(self, step: Step, seq: Seq, count: int, rows: list[Row]) -> None:
        """Reserve `count` slots for `seq`; `rows` sample from its last token's logits."""
        step.rows += rows
        step.logit_rows += [len(step.work)] * len(rows)
        step.work.append(Work(seq, count, self.manager.reserve(seq.table, count)))

    def _make_room(self, entry: Entry, needed: int) -> bool:
        """Preempt younger sampling requests until `needed` blocks are available; False if
        `entry` itself was preempted."""
        while needed > self.main.pool.num_available:
            victim = [e for e in self.running if e.program is None][-1]
            self._preempt(victim)
            if victim is entry:
                return False
        return True

    def _preempt(self, entry: Entry) -> None:
        for seq in entry.seqs:
            seq.member.close(seq)  # its tokens stay; its table is empty until readmitted
        self.running.remove(entry)
        self.waiting.appendleft(entry)
        self.preemptions += 1

    def start_decoding(self, step: Step) -> None:
        """After the forward: the prefilled sequences get RunningKV rows, and samples
        1..n-1 of a fresh request fork sample 0 (its blocks shared, its row copied)."""
        running_kv = self.main.running_kv
        forked = {id(entry.seqs[0]) for entry in step.forks}
        for work in step.work:
            seq = work.seq
            if seq.lane is None and id(seq) not in forked:
                seq.lane = running_kv.add(seq, seq.table.blocks, seq.table.length)
        for entry in step.forks:
            parent = entry.seqs[0]
            for row in entry.request.rows[1:]:
                table = self.manager.fork(parent.table)
                entry.seqs.append(Seq(list(parent.tokens), table, self.main, row=row))
            lanes = running_kv.add_shared(entry.seqs, parent.table.blocks, parent.table.length)
            for seq, lane in zip(entry.seqs, lanes):
                seq.lane = lane
