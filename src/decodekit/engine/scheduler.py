"""Continuous batching: which requests run in the next step, and their KV slots.

One interface (`Entry`, entry.py) for every request the engine runs: a sampling request
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
from dataclasses import dataclass, field

from decodekit.engine.config import EngineConfig
from decodekit.engine.entry import Entry, ProgramEntry, SamplingEntry
from decodekit.engine.members import Members, ModelKV
from decodekit.engine.program import Feed, Seq
from decodekit.request import Row


@dataclass
class Work:
    """A sequence's part of the step: `count` new tokens written at `slots`."""

    seq: Seq
    count: int
    slots: list[int]
    every: bool = False  # keep the logits of every new token (a program's verification)


@dataclass
class Step:
    """What one engine step computes: `schedule` fills the sampling part and the programs,
    engine.py's run adds the programs' feeds on the engine's model."""

    work: list[Work] = field(default_factory=list)  # sampling sequences, a request's together
    rows: list[Row] = field(default_factory=list)  # the rows that receive a token, in logits order
    logit_rows: list[int] = field(default_factory=list)  # for each row, its index into the kept logits
    sampled: list[SamplingEntry] = field(default_factory=list)  # the requests of `rows`, oldest first
    forks: list[SamplingEntry] = field(default_factory=list)  # fresh: samples 1..n-1 fork sample 0
    programs: list[ProgramEntry] = field(default_factory=list)  # the running programs, oldest first
    parked: list[ProgramEntry] = field(default_factory=list)  # programs waiting on the engine's forward
    feeds: list[tuple[ProgramEntry, int, Feed]] = field(default_factory=list)  # (program, forward, feed)
    feed_work: list[Work] = field(default_factory=list)  # the feeds' slots, in `feeds` order


class Scheduler:
    """members: the engine's KV per model (members.py), its own model's `main` among them."""

    def __init__(self, members: Members, config: EngineConfig):
        self.members = members
        self.config = config
        self.waiting: deque[Entry] = deque()
        self.running: list[Entry] = []  # oldest first
        self.admitting: Entry | None = None  # the entry whose admission is under way (failure.py)
        self.prefill_tokens = 0  # prompt (and recomputed) tokens computed
        self.cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.preemptions = 0

    @property
    def main(self) -> ModelKV:
        return self.members.main

    @property
    def manager(self):
        return self.main.manager

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, entry: Entry) -> None:
        """Drop an entry (finished, cancelled or failed) and free its blocks; what it
        computed stays in the prefix cache."""
        for seq in entry.seqs:
            seq.model_kv.close(seq)
        entry.seqs.clear()
        if entry in self.running:
            self.running.remove(entry)
        elif entry in self.waiting:
            self.waiting.remove(entry)
        if entry.needs:
            self.hold()  # what it held is free again

    def hold(self) -> None:
        """Hold, in each pool, the blocks running programs may still allocate."""
        held = {id(model_kv): 0 for model_kv in self.members}
        for entry in self.running:
            for model_kv, needed in entry.needs:
                held[id(model_kv)] += max(0, needed - entry.blocks_used(model_kv))
        for model_kv in self.members:
            model_kv.pool.held = held[id(model_kv)]

    def schedule(self) -> Step:
        step = Step()
        self.admitting = None
        for entry in list(self.running):
            if entry in self.running:  # not preempted making room for an older one
                entry.schedule(self, step)
        self._admit(step)
        return step

    def _admit(self, step: Step) -> None:
        budget = self.config.max_prefill_tokens
        live = sum(len(e.seqs) for e in self.running)
        while self.waiting:
            entry = self.waiting[0]
            samples = len(entry.seqs) if entry.started else entry.num_samples
            if live + samples > self.config.max_running and self.running:
                return
            self.admitting = entry
            admitted = entry.admit(self, step, budget)
            self.admitting = None
            if admitted is None:
                return
            self.waiting.popleft()
            self.running.append(entry)
            entry.started = True
            budget -= admitted
            live += samples

    def add_work(self, step: Step, seq: Seq, count: int, rows: list[Row]) -> None:
        """Reserve `count` slots for `seq`; `rows` sample from its last token's logits."""
        step.rows += rows
        step.logit_rows += [len(step.work)] * len(rows)
        step.work.append(Work(seq, count, self.manager.reserve(seq.table, count)))

    def make_room(self, entry: Entry, needed: int) -> bool:
        """Preempt younger preemptible entries until `needed` blocks are available; False
        if `entry` itself was preempted."""
        while needed > self.main.pool.num_available:
            victim = [e for e in self.running if e.preemptible][-1]
            self._preempt(victim)
            if victim is entry:
                return False
        return True

    def _preempt(self, entry: Entry) -> None:
        for seq in entry.seqs:
            seq.model_kv.close(seq)  # its tokens stay; its table is empty until readmitted
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
