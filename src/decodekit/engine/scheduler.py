"""Continuous batching: which sequences run in the next step, and their KV slots.

Each step (Orca, Yu et al. 2022; vLLM's scheduler):
1. every running sequence decodes one token: its slot is reserved, oldest request
   first; when the pool runs dry the youngest running request is preempted (its blocks
   freed, its generated tokens kept) and goes back to the front of the queue;
2. waiting requests are admitted in arrival order while sequences, prompt tokens and
   blocks allow. A new request prefills its prompt once, as one sequence, reusing any
   cached prefix; its other n - 1 samples are forked from it after the forward. A
   preempted request recomputes each sample's prompt + generated tokens.

All samples of a request run in the same steps, so a request's rows stay together and
its `SamplerState` rows line up with them (request.py). A request is admitted
only if its samples fit the pool alone, so the oldest request can always finish.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from decodekit.engine.config import EngineConfig
from decodekit.engine.kv import BlockManager, BlockTable
from decodekit.engine.rows import RunningKV
from decodekit.request import Delta, Request, Row, cancel_rows


@dataclass(eq=False)
class Sequence:
    """One sample's tokens (prompt + generated), its KV blocks and its RunningKV row."""

    row: Row
    tokens: list[int]
    table: BlockTable = field(default_factory=BlockTable)
    lane: int | None = None  # its row in RunningKV while it decodes


@dataclass(eq=False)
class EngineRequest:
    request: Request
    handle: Any  # engine.RequestHandle
    seqs: list[Sequence] = field(default_factory=list)  # live samples, in the state's row order
    started: bool = False  # prefilled at least once (a preempted request recomputes)
    cancelled: bool = False
    queue: Any = None  # where it waits for admission (the scheduler's queue), set by the engine
    leave: Any = None  # () -> None: out of the engine, its KV freed (`Scheduler.remove`)

    def finals(self) -> list[Delta]:
        """The deltas that end its unfinished samples when it is cancelled."""
        return cancel_rows(self.request.rows)


@dataclass
class Work:
    """A sequence's part of the step: `count` new tokens written at `slots`."""

    seq: Sequence  # or a program's `Seq` (program.py)
    count: int
    slots: list[int]
    every: bool = False  # keep the logits of every new token (a program's verification)


@dataclass
class Step:
    work: list[Work]  # in row order: each request's sequences together
    rows: list[Row]  # the rows that receive a token, in logits order
    logit_rows: list[int]  # for each row, its index into the kept logits
    forks: list[EngineRequest]  # fresh requests whose samples 1..n-1 fork sample 0 after it


def blocks_alone(request: Request, block_size: int) -> int:
    """Blocks a request needs at most with nothing else running (prompt blocks shared)."""
    prompt = len(request.prompt_ids)
    longest = prompt + request.params.max_new_tokens
    per_sample = -(-longest // block_size) - prompt // block_size
    return prompt // block_size + request.params.n * per_sample


class Scheduler:
    def __init__(self, manager: BlockManager, running_kv: RunningKV, config: EngineConfig):
        self.manager = manager
        self.running_kv = running_kv
        self.config = config
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []  # oldest first
        self.prefill_tokens = 0  # prompt (and recomputed) tokens computed
        self.cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, entry: EngineRequest) -> None:
        """Drop a request (finished or cancelled) and free its blocks."""
        for seq in entry.seqs:
            self.release(seq)
        if entry in self.running:
            self.running.remove(entry)
        elif entry in self.waiting:
            self.waiting.remove(entry)

    def schedule(self) -> Step:
        step = Step([], [], [], [])
        for entry in list(self.running):
            if entry not in self.running:
                continue  # preempted while making room for an older request
            # Reserved at once, so the next request's room counts these blocks as taken; a
            # request's victims are always younger than it, so no reserved one is preempted.
            if self._make_room(entry, [(seq.table, 1) for seq in entry.seqs]):
                for seq in entry.seqs:
                    self._add(step, seq, 1, [seq.row])
        self._admit(step)
        return step

    def _admit(self, step: Step) -> None:
        budget = self.config.max_prefill_tokens
        live = sum(len(e.seqs) for e in self.running)
        while self.waiting:
            entry = self.waiting[0]
            fresh = not entry.started
            samples = len(entry.request.rows) if fresh else len(entry.seqs)
            if live + samples > self.config.max_running and self.running:
                return
            if fresh:
                entry.seqs = [Sequence(entry.request.rows[0], list(entry.request.prompt_ids))]
            seqs = entry.seqs
            tables = [self.manager.new_table(seq.tokens) for seq in seqs]
            counts = [len(seq.tokens) - t.length for seq, t in zip(seqs, tables)]
            size = self.manager.block_size
            forks = len(entry.request.rows) - 1 if fresh and len(seqs[0].tokens) % size else 0
            needed = sum(self.manager.blocks_needed(t, c) for t, c in zip(tables, counts)) + forks
            over_budget = sum(counts) > budget and budget < self.config.max_prefill_tokens
            if over_budget or needed > self.manager.pool.num_available:
                for table in tables:
                    self.manager.free(table)  # back to the cache's idle list
                return
            self.waiting.popleft()
            self.running.append(entry)
            entry.started = True
            budget -= sum(counts)
            live += samples
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

    def _add(self, step: Step, seq: Sequence, count: int, rows: list[Row]) -> None:
        """Reserve `count` slots for `seq`; `rows` sample from its last token's logits."""
        step.rows += rows
        step.logit_rows += [len(step.work)] * len(rows)
        step.work.append(Work(seq, count, self.manager.reserve(seq.table, count)))

    def _make_room(self, entry: EngineRequest, needs: list[tuple[BlockTable, int]]) -> bool:
        """Preempt younger requests until `needs` fit; False if `entry` itself was preempted."""
        needed = sum(self.manager.blocks_needed(table, count) for table, count in needs)
        while needed > self.manager.pool.num_available:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is entry:
                return False
        return True

    def release(self, seq: Sequence) -> None:
        """Free a sequence's blocks and its RunningKV row."""
        self.manager.free(seq.table)
        if seq.lane is not None:
            self.running_kv.leave(seq)

    def _preempt(self, entry: EngineRequest) -> None:
        for seq in entry.seqs:
            self.release(seq)
        self.running.remove(entry)
        self.waiting.appendleft(entry)
        self.preemptions += 1

    def start_decoding(self, step: Step) -> None:
        """After the forward: the prefilled sequences get RunningKV rows, and samples
        1..n-1 of a fresh request fork sample 0 (its blocks shared, its row copied)."""
        forked = {id(entry.seqs[0]) for entry in step.forks}
        for work in step.work:
            seq = work.seq
            if seq.lane is None and id(seq) not in forked:
                seq.lane = self.running_kv.add(seq, seq.table.blocks, seq.table.length)
        for entry in step.forks:
            parent = entry.seqs[0]
            for row in entry.request.rows[1:]:
                child = Sequence(row, list(parent.tokens), self.manager.fork(parent.table))
                entry.seqs.append(child)
            lanes = self.running_kv.add_shared(entry.seqs, parent.table.blocks, parent.table.length)
            for seq, lane in zip(entry.seqs, lanes):
                seq.lane = lane
