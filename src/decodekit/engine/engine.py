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
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

import torch

from decodekit.completion import Completion
from decodekit.engine.batch import build_batch, paged_forward
from decodekit.engine.config import EngineConfig
from decodekit.engine.kv import BlockManager, BlockPool
from decodekit.engine.prefix_cache import PrefixCache
from decodekit.engine.rows import RunningKV
from decodekit.engine.scheduler import EngineRequest, Scheduler, Step, blocks_alone
from decodekit.models.base import LanguageModel
from decodekit.params import SamplingParams
from decodekit.request import (
    Delta,
    Prompt,
    Request,
    drop_finished_rows,
    emit,
    make_requests,
    next_delta,
    sample_rows,
)


class EngineFull(RuntimeError):
    """`submit` beyond `EngineConfig.max_waiting` queued requests (a server answers 503)."""


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
        self._wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
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
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._events:
                    delta, future = self._events.popleft(), None
                elif self._done:
                    break
                else:
                    delta, future = None, loop.create_future()
                    self._wakers.append((loop, future))
            if future is not None:
                await future
            else:
                yield delta
        if self._error is not None:
            raise self._error

    def _push(self, deltas: list[Delta], finished: bool = False, error=None) -> None:
        with self._cond:
            for delta in deltas:
                self._events.append(delta)
                if delta.completion is not None:
                    self._completions[delta.sample_index] = delta.completion
            self._done = self._done or finished
            self._error = self._error or error
            self._cond.notify_all()
            wakers, self._wakers = self._wakers, []
        for loop, future in wakers:
            loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future) -> None:
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
        item = torch.empty((), dtype=model.dtype).element_size()
        bytes_per_block = 2 * c.num_layers * config.block_size * c.num_kv_heads * c.head_dim * item
        self.pool = BlockPool(
            c.num_layers,
            config.num_blocks_for(bytes_per_block),
            config.block_size,
            c.num_kv_heads,
            c.head_dim,
            model.dtype,
            PrefixCache() if config.prefix_caching else None,
            device=model.device,
        )
        # The model's batch-invariant mode as it is now holds for this engine's life.
        self.batch_invariant = model.batch_invariant
        self.windows = c.layer_windows
        share = not (self.batch_invariant or c.layer_windows)
        self.running_kv = RunningKV(self.pool, share_prefixes=share)
        self.scheduler = Scheduler(BlockManager(self.pool), self.running_kv, config)
        self._lock = threading.Condition()
        self._incoming: deque[EngineRequest] = deque()
        self._cancelled: list[EngineRequest] = []
        self._step_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._starts = 0  # `start` calls not yet undone by `stop`
        self.steps = 0
        self.generated_tokens = 0
        self.peak_blocks_used = 0
        self._forward = paged_forward
        if config.compile:
            self._forward = torch.compile(paged_forward, dynamic=True)

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

    def add(self, request: Request, request_id: str | None = None) -> RequestHandle:
        """Queue a request built by `request.make_requests` (its `index` is kept)."""
        needed = blocks_alone(request, self.config.block_size)
        if needed > self.pool.num_blocks:
            raise ValueError(
                f"the request needs up to {needed} KV blocks (prompt of "
                f"{len(request.prompt_ids)} tokens, max_new_tokens={request.params.max_new_tokens}, "
                f"n={request.params.n}), more than the engine's {self.pool.num_blocks}"
            )
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        entry = EngineRequest(request, None)
        entry.handle = RequestHandle(request_id, len(request.rows), lambda: self._cancel(entry))
        with self._lock:
            queued = len(self._incoming) + len(self.scheduler.waiting)
            if queued >= self.config.max_waiting:
                raise EngineFull(f"{queued} requests are waiting (max_waiting={self.config.max_waiting})")
            self._incoming.append(entry)
            self._lock.notify_all()
        return entry.handle

    def _cancel(self, entry: EngineRequest) -> None:
        with self._lock:
            if not entry.cancelled and not entry.handle.done:
                entry.cancelled = True
                self._cancelled.append(entry)
                self._lock.notify_all()

    def has_work(self) -> bool:
        return bool(self._incoming or self._cancelled or self.scheduler.has_work())

    # ------------------------------------------------------------------ stepping

    def step(self) -> None:
        """One iteration: admit, prefill, decode one token for every running sequence."""
        with self._step_lock, torch.inference_mode():
            self._take_incoming()
            if not self.scheduler.has_work():
                return
            step = self.scheduler.schedule()
            self.peak_blocks_used = max(self.peak_blocks_used, self.pool.num_used)
            if step.work:
                self._run(step)

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
            self.scheduler.remove(entry)
            rows = [row for row in entry.request.rows if row.finish_reason is None]
            for row in rows:
                row.finish_reason = "cancelled"
            finals = [next_delta(row) for row in rows]
            entry.handle._push(finals, finished=True)

    def _run(self, step: Step) -> None:
        # The decoding sequences first, in the order of their RunningKV rows (batch.py).
        decoding = sorted((w for w in step.work if w.seq.lane is not None),
                          key=lambda w: w.seq.lane)  # fmt: skip
        assert len(decoding) == len(self.running_kv)
        ordered = decoding + [w for w in step.work if w.seq.lane is None]
        position = {id(work): i for i, work in enumerate(ordered)}
        if decoding:
            self.running_kv.grow(1)
        items = [(w.seq.table, w.seq.tokens, w.slots) for w in ordered]
        batch = build_batch(self.pool, items, self.running_kv, self.windows)
        logits = self._forward(self.model, *batch, self.batch_invariant)
        manager = self.scheduler.manager
        for work in step.work:
            manager.register(work.seq.table, work.seq.tokens, work.seq.table.length)
        self.scheduler.start_decoding(step)
        rows = [position[id(step.work[i])] for i in step.logit_rows]
        sample_rows(logits[rows], step.rows)  # [R, V]: one token per row
        self.steps += 1
        self.generated_tokens += len(step.rows)
        entries = {id(row.request): row.request for row in step.rows}
        by_request = {id(e.request): e for e in self.scheduler.running if id(e.request) in entries}
        deltas: dict[int, list[Delta]] = {key: [] for key in by_request}
        for delta, row in _emit_rows(step.rows, self.model.max_context):
            deltas[id(row.request)].append(delta)
        drop_finished_rows(step.rows)
        for key, entry in by_request.items():
            for seq in entry.seqs:
                seq.tokens.append(seq.row.token_ids[-1])
                if seq.row.finish_reason is not None:
                    manager.register_last(seq.table, seq.tokens)  # its KV stays cached
                    self.scheduler.release(seq)
            entry.seqs = [seq for seq in entry.seqs if seq.row.finish_reason is None]
            if not entry.seqs:
                self.scheduler.remove(entry)
            entry.handle._push(deltas[key], finished=not entry.seqs)

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
            except Exception as error:  # noqa: BLE001 -- handed to every waiting consumer
                self.fail_all(error)

    def fail_all(self, error: BaseException) -> None:
        """End every queued and running request with `error` (after a step raised)."""
        entries = list(self.scheduler.running) + list(self.scheduler.waiting)
        with self._lock:
            entries += list(self._incoming)
            self._incoming.clear()
        for entry in entries:
            self.scheduler.remove(entry)
            entry.handle._push([], finished=True, error=error)

    def stats(self) -> dict:
        pool, scheduler = self.pool, self.scheduler
        cached = len(pool.cache) if pool.cache is not None else 0
        return {
            "running_requests": len(scheduler.running),
            "running_sequences": sum(len(e.seqs) for e in scheduler.running),
            "waiting_requests": len(scheduler.waiting) + len(self._incoming),
            "total_blocks": pool.num_blocks,
            "used_blocks": pool.num_used,
            "free_blocks": pool.num_free,
            "cached_blocks": cached,
            "idle_cached_blocks": pool.num_available - pool.num_free,
            "peak_used_blocks": self.peak_blocks_used,
            "block_bytes": pool.bytes_per_block,
            "running_rows_bytes": self.running_kv.nbytes,
            "prefill_tokens": scheduler.prefill_tokens,
            "prefix_cache_hit_tokens": scheduler.cached_tokens,
            "preemptions": scheduler.preemptions,
            "steps": self.steps,
            "generated_tokens": self.generated_tokens,
        }


def _emit_rows(rows, context: int):
    """`emit`'s deltas paired with their rows."""
    for row in rows:
        for delta in emit([row], context):
            yield delta, row

