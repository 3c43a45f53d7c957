"""What the scheduler runs: an `Entry`, one interface for a sampling request and a program.

A sampling request (`SamplingEntry`, request.py) gets one token per row per step from its
own chain; a program (`ProgramEntry`, program.py: beam search, speculative and contrastive
decoding) chooses its own tokens. Each kind says, in its own methods, what the scheduler
(scheduler.py) and the engine ask of every entry: how many samples it has and the most
blocks it can need (`num_samples`, `blocks_alone`), what it reserves at the start of a step
(`schedule`) and at admission (`admit`), whether it can be preempted, and the deltas that
end it when it is cancelled (`finals`). Nothing in engine/ asks which kind an entry is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import singledispatch
from typing import TYPE_CHECKING, Any, ClassVar

from decodekit.engine.block_pool import BlockTable
from decodekit.engine.members import ModelKV
from decodekit.engine.program import Forward, Program, ProgramKV, Seq
from decodekit.models.base import LanguageModel
from decodekit.request import Delta, Request, cancel_rows, drop_finished_rows, step_delta

if TYPE_CHECKING:
    from decodekit.engine.members import Members
    from decodekit.engine.scheduler import Scheduler, Step


@dataclass(eq=False)
class Entry(ABC):
    """A queued or running request of either kind."""

    handle: Any = None  # handle.RequestHandle
    seqs: list[Seq] = field(default_factory=list)  # live sequences (a request's in row order)
    models: list[LanguageModel] = field(default_factory=list)  # whose KV it uses besides ours
    needs: list[tuple[ModelKV, int]] = field(default_factory=list)  # held worst case, per pool
    started: bool = False  # admitted at least once (a preempted request recomputes)
    cancelled: bool = False
    kind: ClassVar[str]  # its name in `Engine.stats`
    preemptible: ClassVar[bool]  # may give back its blocks between steps and recompute

    @property
    @abstractmethod
    def num_samples(self) -> int: ...

    @abstractmethod
    def blocks_alone(self, model: LanguageModel, block_size: int) -> int:
        """Blocks of `model` it needs at most with nothing else running."""

    @abstractmethod
    def finals(self) -> list[Delta]:
        """The deltas that end its unfinished samples when it is cancelled."""

    @abstractmethod
    def attach(self, model: LanguageModel, members: Members, block_size: int) -> None:
        """Bind it to an engine of `model` (`Engine.add`)."""

    def describe(self) -> str:
        """Its size, for the error of one too large for the pool."""
        return ""

    @abstractmethod
    def schedule(self, scheduler: Scheduler, step: Step) -> None:
        """At the start of a step, while it runs: reserve what this step computes for it."""

    @abstractmethod
    def admit(self, scheduler: Scheduler, step: Step, budget: int) -> int | None:
        """Start it if it fits: the prompt tokens it computes now, or None if it must wait."""

    def blocks_used(self, model_kv: ModelKV) -> int:
        return len({b for seq in self.seqs if seq.model_kv is model_kv for b in seq.table.blocks})


@dataclass(eq=False)
class SamplingEntry(Entry):
    """A sampling request: its rows decode one token each per step, sampled together with
    every other request's (`finish_rows`)."""

    request: Request | None = None
    kind: ClassVar[str] = "request"
    preemptible: ClassVar[bool] = True

    @property
    def num_samples(self) -> int:
        return len(self.request.rows)

    def blocks_alone(self, model: LanguageModel, block_size: int) -> int:
        return blocks_alone(self.request, block_size)

    def finals(self) -> list[Delta]:
        return cancel_rows(self.request.rows)

    def attach(self, model: LanguageModel, members: Members, block_size: int) -> None:
        pass  # it runs on the engine's model only, in the engine's pool

    def describe(self) -> str:
        prompt, params = self.request.prompt_ids, self.request.params
        return f" (prompt of {len(prompt)} tokens, max_new_tokens={params.max_new_tokens}, n={params.n})"

    def schedule(self, scheduler: Scheduler, step: Step) -> None:
        """Every sequence decodes one token: its slot is reserved at once, so the next
        request's room counts these blocks as taken; a request's victims are always younger
        than it, so no reserved one is preempted."""
        manager = scheduler.manager
        if scheduler.make_room(self, sum(manager.blocks_needed(s.table, 1) for s in self.seqs)):
            for seq in self.seqs:
                scheduler.add_work(step, seq, 1, [seq.row])
            step.sampled.append(self)

    def admit(self, scheduler: Scheduler, step: Step, budget: int) -> int | None:
        """Prefill its sequences if their blocks and the prompt budget allow: a fresh request
        prefills its prompt once, as one sequence, reusing any cached prefix (its other
        samples fork it after the forward); a preempted one recomputes each sample."""
        manager, request = scheduler.manager, self.request
        fresh = not self.started
        if fresh:
            self.seqs = [Seq(list(request.prompt_ids), BlockTable(), scheduler.main, row=request.rows[0])]
        seqs = self.seqs
        tables = [manager.new_table(seq.tokens) for seq in seqs]
        counts = [len(seq.tokens) - t.length for seq, t in zip(seqs, tables)]
        forks = len(request.rows) - 1 if fresh and len(seqs[0].tokens) % manager.block_size else 0
        needed = sum(manager.blocks_needed(t, c) for t, c in zip(tables, counts)) + forks
        over_budget = sum(counts) > budget and budget < scheduler.config.max_prefill_tokens
        if over_budget or needed > scheduler.main.pool.num_available:
            for table in tables:
                manager.free(table)  # back to the cache's idle list
            return None
        scheduler.prefill_tokens += sum(counts)
        scheduler.cached_tokens += sum(t.length for t in tables)
        if fresh:
            request.cached_prompt_tokens = tables[0].length
        for seq, table, count in zip(seqs, tables, counts):
            seq.table = table
            # n samples of a fresh prompt all read its one row of logits
            scheduler.add_work(step, seq, count, request.rows if fresh else [seq.row])
        if fresh and len(request.rows) > 1:
            step.forks.append(self)
        step.sampled.append(self)
        return sum(counts)


@dataclass(eq=False)
class ProgramEntry(Entry):
    """A program: it reserves its own slots as it feeds (rounds.py), from the worst case it
    holds from admission on (`Program.needs`), so it is never preempted."""

    program: Program | None = None
    kv: ProgramKV | None = None  # its handle on the KV, tracking `seqs`
    # Its step in progress (rounds.py): the generator, the forwards it waits on and their
    # logits so far.
    generator: Any = None
    forwards: list[Forward] = field(default_factory=list)
    results: list[list[Any]] = field(default_factory=list)
    kind: ClassVar[str] = "program"
    preemptible: ClassVar[bool] = False

    @property
    def num_samples(self) -> int:
        return self.program.num_samples

    def blocks_alone(self, model: LanguageModel, block_size: int) -> int:
        return sum(n for m, n in self.program.needs(block_size) if m is model)

    def finals(self) -> list[Delta]:
        return self.program.cancel()

    def attach(self, model: LanguageModel, members: Members, block_size: int) -> None:
        self.kv = ProgramKV(model, members.of, self.seqs)
        self.models = [model for model, _ in self.program.needs(block_size)]

    def schedule(self, scheduler: Scheduler, step: Step) -> None:
        step.programs.append(self)  # it feeds itself

    def admit(self, scheduler: Scheduler, step: Step, budget: int) -> int | None:
        """Hold its worst case if it fits; it computes nothing now."""
        block_size = scheduler.config.block_size
        needs = [(scheduler.members.of(model), n) for model, n in self.program.needs(block_size)]
        if any(needed > model_kv.pool.num_available for model_kv, needed in needs):
            return None
        self.needs = needs
        for model_kv, needed in needs:
            model_kv.pool.held += needed
        step.programs.append(self)
        return 0


def blocks_alone(request: Request, block_size: int) -> int:
    """Blocks a request needs at most with nothing else running (prompt blocks shared)."""
    prompt = len(request.prompt_ids)
    longest = prompt + request.params.max_new_tokens
    per_sample = -(-longest // block_size) - prompt // block_size
    return prompt // block_size + request.params.n * per_sample


@singledispatch
def entry_for(item) -> Entry:
    """The entry of a sampling request or a program."""
    raise TypeError(f"the engine runs a Request or a Program, got {type(item).__name__}")


@entry_for.register
def _(item: Request) -> Entry:
    return SamplingEntry(request=item)


@entry_for.register
def _(item: Program) -> Entry:
    return ProgramEntry(program=item)


def finish_rows(step: Step, context: int, remove) -> list:
    """After `sample_rows`: each sampled request's rows take their tokens, its deltas are
    queued, its finished samples freed (their KV stays cached) and, once all are, it is
    removed (`remove`). Returns the readers to wake (handle.py `wake`)."""
    deltas: dict[int, list[Delta]] = {id(entry.request): [] for entry in step.sampled}
    for row in step.rows:
        delta = step_delta(row, context)
        if delta is not None:
            deltas[id(row.request)].append(delta)
    drop_finished_rows(step.rows)
    wakers = []
    for entry in step.sampled:
        ended = False
        for seq in entry.seqs:
            seq.tokens.append(seq.row.token_ids[-1])
            if seq.row.finish_reason is not None:
                seq.model_kv.close(seq)  # its KV stays cached
                ended = True
        if ended:
            entry.seqs = [seq for seq in entry.seqs if seq.row.finish_reason is None]
            if not entry.seqs:
                remove(entry)  # no sample left to free
        wakers += entry.handle._push(deltas[id(entry.request)], finished=not entry.seqs)
    return wakers
