"""The engine: continuous batching of many requests over one NativeLM and a paged KV cache.

    engine = Engine(model, EngineConfig(max_kv_bytes=256 * 2**20))
    handle = engine.submit("ROMEO:", SamplingParams(n=4, seed=0))   # thread-safe
    engine.start()                                                   # or call engine.step()
    for delta in handle: ...                                         # or handle.result()

A step (`step`) admits waiting requests, runs one forward over every scheduled token
(batch.py) and samples one token for every row with the request's own chain and
generator (request.py: `sample_rows`, `record`, `emit`), so a seeded request's
random stream is the same alone or beside others; with the model's `batch_invariant` on
(read when the engine is built) its logits are too, bit for bit, and so are its tokens
and logprobs. Requests join and leave between steps.
`decodekit.generate` runs models that support paged KV (`LanguageModel.supports_paged_kv`:
NativeLM) on the model's persistent engine (shared.py: `engine_for`, `run_requests`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Iterator

import torch

from decodekit.completion import Completion
from decodekit.engine.batch import build_batch, paged_forward
from decodekit.engine.compile_worker import STEPS
from decodekit.engine.compiled import CompilePolicy, PrefixKV, bucket, eligible, lanes_for
from decodekit.engine.config import EngineConfig
from decodekit.engine.kv import BlockPool, PoolCorrupted, block_bytes
from decodekit.engine.prefix_cache import PrefixCache
from decodekit.engine.program import Feed, Member, Program, ProgramKV
from decodekit.engine.rows import RunningKV
from decodekit.engine.scheduler import Entry, Scheduler, Step, Work, entry_for
from decodekit.models.base import LanguageModel
from decodekit.params import SamplingParams
from decodekit.request import (
    Delta,
    Prompt,
    Request,
    drop_finished_rows,
    emit,
    make_requests,
    sample_rows,
)

_log = logging.getLogger(__name__)


class EngineFull(RuntimeError):
    """`submit` beyond `EngineConfig.max_waiting` queued requests (a server answers 503)."""


Waker = tuple[asyncio.AbstractEventLoop, asyncio.Future]  # a reader waiting in `abatches`


class RequestHandle:
    """A submitted request: its deltas as they come, and its n completions at the end.

    One consumer reads the deltas (iterate, `aiter` or `poll`); `result` can be called
    by anyone. A cancelled request ends its unfinished samples with finish_reason
    "cancelled".
    """

    def __init__(self, request_id: str, num_samples: int, on_cancel: Callable[[], None]):
        self.request_id = request_id
        self._cond = threading.Condition()
        self._events: deque[Delta] = deque()
        self._completions: list[Completion | None] = [None] * num_samples
        self._done = False
        self._error: BaseException | None = None
        self._wakers: list[Waker] = []
        self._on_cancel = on_cancel

    @property
    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        """Stop the request; its KV blocks are freed at the engine's next step."""
        self._on_cancel()

    def result(self, timeout: float | None = None) -> list[Completion]:
        """The n completions, in sample order, once every sample has finished."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish in {timeout} s")
        if self._error is not None:
            raise self._error
        return list(self._completions)  # type: ignore[arg-type]

    def poll(self) -> list[Delta]:
        """The deltas that arrived since the last read, without waiting."""
        with self._cond:
            events = list(self._events)
            self._events.clear()
        return events

    def __iter__(self) -> Iterator[Delta]:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._events or self._done)
                if not self._events:
                    break
                delta = self._events.popleft()
            yield delta
        if self._error is not None:
            raise self._error

    async def aiter(self) -> AsyncIterator[Delta]:
        """Async iteration for an event loop (FastAPI): the engine thread wakes it."""
        async for batch in self.abatches():
            for delta in batch:
                yield delta

    async def abatches(self) -> AsyncIterator[list[Delta]]:
        """The deltas as they arrived together (an engine step's at once): one wake-up of the
        reader and one write of a stream per step, however many samples the request has."""
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._events:
                    batch, future = list(self._events), None
                    self._events.clear()
                elif self._done:
                    break
                else:
                    batch, future = [], loop.create_future()
                    self._wakers.append((loop, future))
            if future is not None:
                await future
            else:
                yield batch
        if self._error is not None:
            raise self._error

    def _push(self, deltas: list[Delta], finished: bool = False, error=None) -> list[Waker]:
        """Queue the deltas; returns the waiting readers, for `wake` (after the step's pushes)."""
        with self._cond:
            for delta in deltas:
                self._events.append(delta)
                if delta.completion is not None:
                    self._completions[delta.sample_index] = delta.completion
            self._done = self._done or finished
            self._error = self._error or error
            self._cond.notify_all()
            wakers, self._wakers = self._wakers, []
        return wakers


def wake(wakers: list[Waker]) -> None:
    """Resolve the readers' futures with one call into each event loop: a step that feeds 64
    streams wakes their loop once, not 64 times (each cross-thread call takes the loop's lock
    and writes to its wake-up pipe)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = {}
    for loop, future in wakers:
        by_loop.setdefault(loop, []).append(future)
    for loop, futures in by_loop.items():
        loop.call_soon_threadsafe(_resolve, futures)


def _resolve(futures: list[asyncio.Future]) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)


class Engine:
    def __init__(self, model: LanguageModel, config: EngineConfig | None = None):
        if not model.supports_paged_kv:
            raise TypeError(
                f"the engine runs models that support paged KV (NativeLM), got {type(model).__name__}"
            )
        self.model = model
        self.config = config = config or EngineConfig()
        c = model.config
        self.pool = _new_pool(model, config)
        # The model's batch-invariant mode as it is now holds for this engine's life.
        self.batch_invariant = model.batch_invariant
        self.windows = c.layer_windows
        share = not (self.batch_invariant or c.layer_windows)
        with torch.inference_mode():  # as it is regrown in steps (a compiled step's guards see one kind)
            self.running_kv = RunningKV(self.pool, share_prefixes=share)
        # The KV of each model requests run on (program.py): this engine's own, then members.
        main = Member(model, self.pool, self.running_kv)
        self.members: dict[int, Member] = {id(model): main}
        self._idle_members: OrderedDict[int, None] = OrderedDict()  # unused, least recent first
        self.scheduler = Scheduler(main, self.members, self.member, config)
        self._lock = threading.Condition()
        self._incoming: deque[Entry] = deque()
        self._cancelled: list[Entry] = []
        self._step_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._starts = 0  # `start` calls not yet undone by `stop`
        self.steps = 0
        self.generated_tokens = 0
        self.peak_blocks_used = 0
        self.resets = 0  # times a failed step left books that disagreed (`_fail_step`)
        self._stepping = False
        self._forward = paged_forward  # the eager forward of every step that is not all decoding
        # The compiled decode step (compiled.py), where this engine's model and modes allow it.
        self.compile_refused = eligible(model, self.pool, self.batch_invariant)
        self.lanes = None
        if config.compile is not False and self.compile_refused is None:
            self.lanes = lanes_for(model)
            self.compile_policy = CompilePolicy.for_model(model, config.compile)
        self.decode_steps = 0  # eager decode-only steps (the policy's evidence) and their mean time
        self.eager_step_s = 0.0
        self.compiled_steps = 0
        self._prefix_kv: PrefixKV | None = None  # the shared prefixes the last compiled step read

    # ------------------------------------------------------------------ requests

    def submit(
        self, prompt: Prompt, params: SamplingParams, *, request_id: str | None = None
    ) -> RequestHandle:
        """Queue one prompt (text or token ids) for `params.n` samples. Thread-safe.

        Raises ValueError/TypeError for a bad prompt or parameters and `EngineFull` when
        `max_waiting` requests are already queued.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        [request] = make_requests(self.model, [prompt], params)
        return self.add(request, request_id)

    def add(self, item: Request | Program, request_id: str | None = None) -> RequestHandle:
        """Queue a sampling request built by `request.make_requests` (its `index` is kept) or
        a program (beam search, speculative or contrastive decoding: program.py)."""
        entry = entry_for(item)
        if entry.program is not None:
            entry.kv = ProgramKV(self.model, self.member, entry.seqs)
            entry.models = [model for model, _ in entry.program.needs(self.config.block_size)]
        for model in [self.model, *entry.models]:
            needed = entry.blocks_alone(model, self.config.block_size)
            total = self.member(model).pool.num_blocks
            if needed > total:
                raise ValueError(f"the request needs up to {needed} KV blocks of {model.name}"
                                 f"{_shape(entry)}, more than the engine's {total}")  # fmt: skip
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        entry.handle = RequestHandle(request_id, entry.num_samples, lambda: self._cancel(entry))
        with self._lock:
            queued = len(self._incoming) + len(self.scheduler.waiting)
            if queued >= self.config.max_waiting:
                raise EngineFull(f"{queued} requests are waiting (max_waiting={self.config.max_waiting})")
            self._incoming.append(entry)
            self._lock.notify_all()
        return entry.handle

    def member(self, model: LanguageModel) -> Member:
        """The KV of `model` on this engine: its own pool for another model (a draft, an
        amateur), built on first use with this engine's block size and memory bound."""
        member = self.members.get(id(model))
        self._idle_members.pop(id(model), None)
        if member is None:
            if not model.supports_paged_kv:
                raise TypeError(f"a program's models must support paged KV, got {type(model).__name__}")
            if getattr(model, "dtype", None) is None or not hasattr(model, "config"):
                raise TypeError(f"{model.name} has no paged-KV configuration")
            member = Member(model, _new_pool(model, self.config))
            member.pool.journal = {} if self._stepping else None
            self.members[id(model)] = member
        return member

    def _cancel(self, entry) -> None:
        with self._lock:
            if not entry.cancelled and not entry.handle.done:
                entry.cancelled = True
                self._cancelled.append(entry)
                self._lock.notify_all()

    def has_work(self) -> bool:
        return bool(self._incoming or self._cancelled or self.scheduler.has_work())

    # ------------------------------------------------------------------ stepping

    def step(self) -> None:
        """One iteration: admit, prefill, decode one token for every running sequence, and
        one step of every running program (program.py).

        A step that raises (a forward, an adapter, a program, an interrupt) fails exactly
        the requests and programs it was running, after giving back every KV slot it
        reserved, so nothing it did not finish writing reaches the prefix cache
        (`_fail_step`); then it raises the error. Waiting requests stay queued and the
        engine stays usable."""
        if self.lanes is not None:
            self.lanes.poll()  # a compilation runs here, between steps (compile_worker.py)
        with STEPS.step(), self._step_lock, torch.inference_mode():
            self._stepping = True
            for member in self.members.values():
                member.pool.journal = {}
            try:
                self._step()
            except BaseException as error:
                self._fail_step(error)
                raise
            finally:
                self._stepping = False
                for member in self.members.values():
                    member.pool.journal = None

    def _step(self) -> None:
        # schedule: the running sampling rows' slots, then admissions (scheduler.py)
        self._take_incoming()
        self.scheduler.hold()
        step = self.scheduler.schedule()
        if not step.work and not step.programs:
            return
        self.peak_blocks_used = max(self.peak_blocks_used, self.pool.num_used)
        # run: the programs' rounds on other models, then one forward of this engine's model
        # over the sampling rows and the programs' feeds; postprocess: sample, and the
        # programs end their steps
        parked = self._program_rounds(step.programs)
        feeds = [(entry, i, feed) for entry in parked for i, fw in enumerate(entry.forwards)
                 if fw.model is self.model for feed in fw.feeds]  # fmt: skip
        if step.work or feeds:
            outputs = self._run(step, [feed for _, _, feed in feeds])
            for (entry, i, _), logits in zip(feeds, outputs, strict=True):
                entry.results[i].append(logits)
        for entry in parked:
            self._resume(entry)

    def _fail_step(self, error: BaseException) -> None:
        """After a step raised: roll back the slots it reserved (kv.py `rollback`: a
        position reserved but not written must never be registered), end every running
        request and program with `error`, then check the pools' books (`check`); books that
        disagree (an interrupt between two updates) cost the KV, not correctness: the
        engine starts over with empty pools (`_reset`)."""
        for member in self.members.values():
            member.manager.rollback()
        if not self._fail_running(error):
            self._fail_queued(error)  # nothing ran: the error came with admission; no retry loop
        try:
            self._check()
        except PoolCorrupted as problem:
            _log.warning("%s after a failed step: the engine starts over with empty pools", problem)
            self._reset()

    def check(self) -> None:
        """Raise `PoolCorrupted` unless every pool's reference counts equal the blocks that
        live sequences hold and every RunningKV lane belongs to the sequence that names it.
        Cheap next to a forward, but not free: called after a failed step, and by tests."""
        with self._step_lock:
            self._check()

    def _check(self) -> None:
        tables: dict[int, list] = {id(m.pool): [] for m in self.members.values()}
        laned = []
        for entry in [*self.scheduler.running, *self.scheduler.waiting]:
            for seq in entry.seqs:
                if id(seq.member.pool) not in tables:
                    raise PoolCorrupted(f"a request holds blocks of {seq.member.model.name}, "
                                        "whose pool the engine no longer has")  # fmt: skip
                tables[id(seq.member.pool)].append(seq.table)
                laned += [seq] if seq.lane is not None else []
        for member in self.members.values():
            member.pool.check(tables[id(member.pool)])
        owners = self.running_kv.owners
        if len(laned) != len(owners) or any(owners[seq.lane] is not seq for seq in laned):
            raise PoolCorrupted(f"{len(owners)} RunningKV rows for {len(laned)} sequences with lanes")

    def _reset(self) -> None:
        """Empty pools, lanes and members (the running requests have been failed)."""
        self.pool = _new_pool(self.model, self.config)
        self.running_kv = RunningKV(self.pool, share_prefixes=self.running_kv.share_prefixes)
        self._prefix_kv = None
        self.scheduler.main = Member(self.model, self.pool, self.running_kv)
        self.members.clear()  # the scheduler's dict too
        self.members[id(self.model)] = self.scheduler.main
        self._idle_members.clear()
        self.resets += 1

    def take_incoming(self) -> None:
        """Queue the submitted requests and drop the cancelled ones (freeing their blocks)."""
        with self._step_lock:
            self._take_incoming()

    def _take_incoming(self) -> None:
        with self._lock:
            incoming, self._incoming = self._incoming, deque()
            cancelled, self._cancelled = self._cancelled, []
        self.scheduler.waiting.extend(incoming)
        for entry in cancelled:
            self._end(entry, entry.finals())

    def _end(self, entry, deltas, error: BaseException | None = None) -> None:
        """Take a request or program out of the engine, its KV freed (what it computed stays
        in the prefix cache), and hand its last deltas (or `error`) to its reader."""
        self.scheduler.remove(entry)
        if entry.models:
            self._retire_members()
        wake(entry.handle._push(deltas, finished=True, error=error))

    # ------------------------------------------------------------------ programs

    def _program_rounds(self, programs: list[Entry]) -> list[Entry]:
        """Start every program's step and run the forwards they need on other models (drafts,
        amateurs), batched per model, until each waits on this engine's model or has ended
        its step. Returns those that wait."""
        active = []
        for entry in programs:
            entry.generator = entry.program.step(entry.kv)
            if self._advance(entry, None):
                active.append(entry)
        while True:
            todo: dict[int, list] = {}  # per model: (entry, index, Forward)
            for entry in active:
                for i, fw in enumerate(entry.forwards):
                    if fw.model is not self.model and not entry.results[i]:
                        todo.setdefault(id(fw.model), []).append((entry, i, fw))
            if not todo:
                return active
            for jobs in todo.values():
                member = self.member(jobs[0][2].model)
                feeds = [feed for _, _, fw in jobs for feed in fw.feeds]
                outputs = iter(self._member_forward(member, feeds))
                for entry, i, fw in jobs:
                    entry.results[i] = [next(outputs) for _ in fw.feeds]
            waiting = []
            for entry in active:
                if any(fw.model is self.model for fw in entry.forwards):
                    waiting.append(entry)  # its member forwards are done; it waits for ours
                elif self._advance(entry, entry.results):
                    waiting.append(entry)
            active = waiting

    def _advance(self, entry: Entry, results) -> bool:
        """Send a program its forwards' logits; True if it asks for more in this step."""
        try:
            forwards = entry.generator.send(results)
        except StopIteration as stop:
            self._deliver(entry, stop.value or [])
            return False
        except Exception as error:  # noqa: BLE001 -- ends this program, not the engine
            self._end(entry, [], error)
            return False
        for fw in forwards:
            for feed in fw.feeds:
                if feed.seq.pending < 1:
                    self._end(entry, [], ValueError("a feed must have a token to compute"))
                    return False
        entry.forwards = forwards
        entry.results = [[] for _ in forwards]
        return True

    def _resume(self, entry: Entry) -> None:
        """After the step's forward: the program ends its step with the logits it waited for."""
        if self._advance(entry, entry.results):
            error = RuntimeError("a program's step must end after its forward on the engine's model")
            self._end(entry, [], error)

    def _deliver(self, entry: Entry, deltas) -> None:
        if entry.program.finished:
            self._end(entry, deltas)
        else:
            wake(entry.handle._push(deltas))

    def _retire_members(self) -> None:
        """Members no queued or running program uses become idle; idle ones beyond
        `EngineConfig.idle_member_bytes` of KV storage are freed, least recently used first
        (a self-int4 draft's copy of the model goes with its member)."""
        entries = [*self.scheduler.running, *self.scheduler.waiting]
        in_use = {id(self.model)} | {id(m) for e in entries for m in e.models}
        in_use |= {id(seq.member.model) for e in entries for seq in e.seqs}
        for key in self.members:
            if key not in in_use and key not in self._idle_members:
                self._idle_members[key] = None
        idle_bytes = sum(self.members[key].pool.nbytes for key in self._idle_members)
        while idle_bytes > self.config.idle_member_bytes:
            key, _ = self._idle_members.popitem(last=False)
            idle_bytes -= self.members.pop(key).pool.nbytes

    def _member_forward(self, member: Member, feeds: list[Feed]) -> list[torch.Tensor]:
        """One forward of another model over programs' feeds (their blocks, no lanes)."""
        works = [Work(f.seq, f.seq.pending, member.manager.reserve(f.seq.table, f.seq.pending), f.every)
                 for f in feeds]  # fmt: skip
        model = member.model
        items = [(w.seq.table, w.seq.tokens, w.slots) for w in works]
        batch = build_batch(member.pool, items, None, model.config.layer_windows,
                            [w.every for w in works])  # fmt: skip
        logits = paged_forward(model, *batch, model.batch_invariant)
        for w in works:
            member.manager.register(w.seq.table, w.seq.tokens, w.seq.table.length)
        return _split(logits, works)

    # ------------------------------------------------------------------ the forward

    def _run(self, step: Step, feeds: list[Feed]) -> list[torch.Tensor]:
        """The step's forward: the scheduled sampling work and the programs' feeds on this
        engine's model. Samples the sampling rows; returns each feed's logits."""
        manager = self.scheduler.manager
        programs = [Work(f.seq, f.seq.pending, manager.reserve(f.seq.table, f.seq.pending), f.every)
                    for f in feeds]  # fmt: skip
        works = step.work + programs
        # The decoding sequences first, in the order of their RunningKV rows (batch.py).
        decoding = sorted((w for w in works if w.seq.lane is not None), key=lambda w: w.seq.lane)
        if len(decoding) != len(self.running_kv) or any(w.count != 1 for w in decoding):
            # A check, not an assert: RunningKV rows that do not line up with the step's
            # sequences would attend over another sequence's KV (the step fails and resets).
            raise PoolCorrupted(f"{len(decoding)} sequences with lanes decode one token each in this "
                                f"step, for {len(self.running_kv)} RunningKV rows")  # fmt: skip
        ordered = decoding + [w for w in works if w.seq.lane is None]
        if decoding:
            self.running_kv.grow(1)
        wants_hidden = any(row.request.wants_hidden for row in step.rows)  # align/qvalue.py
        only_decoding = len(ordered) == len(decoding) and not wants_hidden and not step.forks
        logits = self._compiled_forward(decoding) if only_decoding and self.lanes is not None else None
        hidden = None
        if logits is None:
            start = time.perf_counter()
            items = [(w.seq.table, w.seq.tokens, w.slots) for w in ordered]
            batch = build_batch(self.pool, items, self.running_kv, self.windows, [w.every for w in ordered])
            out = self._forward(self.model, *batch, self.batch_invariant, wants_hidden)
            logits, hidden = out if wants_hidden else (out, None)
            if only_decoding and self.lanes is not None:
                self._count_eager(len(decoding), time.perf_counter() - start)
        sizes = [w.count if w.every else 1 for w in ordered]
        ends = dict(zip(map(id, ordered), itertools.accumulate(sizes), strict=True))
        by_work = dict(zip(map(id, ordered), logits.split(sizes), strict=True)) if programs else {}
        for work in works:
            manager.register(work.seq.table, work.seq.tokens, work.seq.table.length)
        self.scheduler.start_decoding(step)
        for feed in feeds:
            seq = feed.seq
            if feed.lane and seq.lane is None:
                seq.lane = self.running_kv.add(seq, seq.table.blocks, seq.table.length)
        self.steps += 1
        if step.rows:
            kept = [ends[id(step.work[i])] - 1 for i in step.logit_rows]
            if kept != list(range(len(logits))):  # a decode-only step keeps every row, in order
                logits, hidden = logits[kept], None if hidden is None else hidden[kept]
            self._sample(step, logits, hidden)
        return [by_work[id(work)] for work in programs]

    def _compiled_forward(self, works: list[Work]) -> torch.Tensor | None:
        """Logits [B, V] of the decoding rows through the compiled step (compiled.py), their
        new keys and values written into the rows and the pool; None when its bucket is not
        compiled (yet)."""
        running_kv = self.running_kv
        self._prefix_kv = prefix = PrefixKV.for_rows(running_kv.prefixes, self._prefix_kv)
        seqs = [work.seq for work in works]
        if (bucket(len(seqs)), prefix is not None) not in self.lanes.ready:
            return None  # not compiled (yet): no inputs to build
        device = running_kv.keys.device  # the step's indices live beside the rows they index
        # each row's token, its position, and the positions its row holds before it: [3, B]
        per_row = torch.tensor([[seq.tokens[seq.table.length - 1] for seq in seqs],
                                [seq.table.length - 1 for seq in seqs],
                                [length - 1 for length in running_kv.lengths]], device=device)  # fmt: skip
        tokens, positions, stored = per_row.unbind()
        bounds = None if prefix is None else torch.tensor(prefix.bounds(running_kv.prefixes), device=device)
        out = self.lanes.run(len(seqs), tokens, positions, stored, running_kv, prefix, bounds)
        if out is None:
            return None
        logits, keys, values = out  # [B, V], [N, B, H_kv, D]
        rows = torch.arange(len(seqs), device=device)
        running_kv.keys[:, rows, :, stored] = keys.transpose(0, 1)  # [B, N, H_kv, D]
        running_kv.values[:, rows, :, stored] = values.transpose(0, 1)
        slots = torch.tensor([work.slots[0] for work in works], device=device)
        self.pool.write_layers(slots, keys.transpose(1, 2), values.transpose(1, 2))  # [N, H_kv, B, D]
        self.compiled_steps += 1
        return logits

    def _count_eager(self, rows: int, seconds: float) -> None:
        """An eager decode-only step: the compile policy's evidence (compiled.py)."""
        self.decode_steps += 1
        self.eager_step_s += (seconds - self.eager_step_s) / self.decode_steps
        prefixed = any(prefix is not None for prefix in self.running_kv.prefixes)
        self.lanes.want(rows, self.compile_policy, self.decode_steps, self.eager_step_s, self.running_kv,
                        prefixed=prefixed)  # fmt: skip

    def _sample(self, step: Step, logits: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        """Sample one token for every row of the step (hidden: their final states, for the
        requests that want them), hand out the deltas, retire the ended."""
        sample_rows(logits, step.rows, hidden)  # [R, V]: one token per row
        self.generated_tokens += len(step.rows)
        entries = {id(row.request): row.request for row in step.rows}
        by_request = {id(e.request): e for e in self.scheduler.running if id(e.request) in entries}
        deltas: dict[int, list[Delta]] = {key: [] for key in by_request}
        for delta, row in _emit_rows(step.rows, self.model.max_context):
            deltas[id(row.request)].append(delta)
        drop_finished_rows(step.rows)
        wakers: list[Waker] = []
        for key, entry in by_request.items():
            for seq in entry.seqs:
                seq.tokens.append(seq.row.token_ids[-1])
                if seq.row.finish_reason is not None:
                    seq.member.close(seq)  # its KV stays cached
            entry.seqs = [seq for seq in entry.seqs if seq.row.finish_reason is None]
            if not entry.seqs:
                self.scheduler.remove(entry)  # no sample left to free
            wakers += entry.handle._push(deltas[key], finished=not entry.seqs)
        wake(wakers)

    # ------------------------------------------------------------------ background thread

    def start(self) -> None:
        """Run `step` in a background thread whenever there is work. Each `start` is undone
        by one `stop`: two servers on one model's shared engine (shared.py) keep it running
        until both stop."""
        with self._lock:
            self._starts += 1
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="decodekit-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the background thread after its current step (queued requests stay), once
        every `start` has had its `stop`."""
        with self._lock:
            self._starts = max(self._starts - 1, 0)
            if self._starts:
                return
            self._stopping = True
            self._lock.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        self._thread = None

    def _loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._stopping or self.has_work())
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as error:  # noqa: BLE001 -- the step failed its own requests
                _log.warning("an engine step failed and ended its requests: %r", error)

    def fail_all(self, error: BaseException) -> None:
        """End every queued and running request with `error` (waits for a running step)."""
        with self._step_lock:
            self._fail_running(error)
            self._fail_queued(error)

    def _fail_running(self, error: BaseException) -> int:
        """End every admitted request and program with `error`; how many there were."""
        running = list(self.scheduler.running)
        for entry in running:
            self._end(entry, [], error)
        return len(running)

    def _fail_queued(self, error: BaseException) -> None:
        """End every request not yet admitted with `error`."""
        with self._lock:
            incoming = list(self._incoming)
            self._incoming.clear()
        for entry in [*incoming, *self.scheduler.waiting]:
            self._end(entry, [], error)

    def stats(self) -> dict:
        """The engine's state: requests (sampling requests and programs alike), its pool's
        blocks, and every member pool's (drafts, amateurs), for /health and /metrics."""
        pool, scheduler = self.pool, self.scheduler
        cached = len(pool.cache) if pool.cache is not None else 0
        programs = [e for e in scheduler.running if e.program is not None]
        queued = [*self._incoming, *scheduler.waiting]
        return {
            "running_requests": len(scheduler.running),
            "running_sequences": sum(len(e.seqs) for e in scheduler.running),
            "waiting_requests": len(queued),
            "total_blocks": pool.num_blocks,
            "used_blocks": pool.num_used,
            "held_blocks": pool.held,
            "free_blocks": pool.num_free,
            "cached_blocks": cached,
            "idle_cached_blocks": pool.cache.num_idle if pool.cache is not None else 0,
            "running_programs": len(programs),
            "waiting_programs": sum(e.program is not None for e in queued),
            "members": {
                member.model.name: _pool_stats(member.pool, key in self._idle_members)
                for key, member in self.members.items()
                if member.pool is not pool
            },  # fmt: skip
            "peak_used_blocks": self.peak_blocks_used,
            "block_bytes": pool.bytes_per_block,
            "running_rows_bytes": self.running_kv.nbytes,
            "prefill_tokens": scheduler.prefill_tokens,
            "prefix_cache_hit_tokens": scheduler.cached_tokens,
            "preemptions": scheduler.preemptions,
            "steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "resets": self.resets,
            # the buckets a compile worker or the next step compiles (compile_worker.py): the
            # CPU a server uses while no request runs
            "compiling": self.lanes.compiling if self.lanes is not None else [],
        }


def _pool_stats(pool: BlockPool, idle: bool) -> dict:
    """A member pool's blocks and bytes."""
    return {
        "used_blocks": pool.num_used,
        "held_blocks": pool.held,
        "cached_blocks": len(pool.cache) if pool.cache is not None else 0,
        "total_blocks": pool.num_blocks,
        "bytes": pool.nbytes,
        "idle": idle,
    }


def _shape(entry: Entry) -> str:
    """A sampling request's size, for the error of one too large for the pool."""
    request = entry.request
    if request is None:
        return ""
    return (f" (prompt of {len(request.prompt_ids)} tokens, max_new_tokens={request.params.max_new_tokens}, "
            f"n={request.params.n})")  # fmt: skip


def _split(logits: torch.Tensor, works: list[Work]) -> list[torch.Tensor]:
    """The kept logits [K, V] of a forward, per work: [count, V] if `every`, else [1, V]."""
    sizes = [w.count if w.every else 1 for w in works]
    return list(logits.split(sizes))


def _new_pool(model, config: EngineConfig) -> BlockPool:
    """A block pool for `model`'s KV within `config`'s bound."""
    c = model.config
    kv_dtype = getattr(torch, config.kv_dtype) if config.kv_dtype else model.dtype
    bytes_per_block = block_bytes(c.num_layers, config.block_size, c.num_kv_heads, c.head_dim, kv_dtype)
    return BlockPool(
        c.num_layers,
        config.num_blocks_for(bytes_per_block),
        config.block_size,
        c.num_kv_heads,
        c.head_dim,
        model.dtype,
        PrefixCache() if config.prefix_caching else None,
        device=model.device,
        kv_dtype=kv_dtype,
    )


def _emit_rows(rows, context: int):
    """`emit`'s deltas paired with their rows."""
    for row in rows:
        for delta in emit([row], context):
            yield delta, row
