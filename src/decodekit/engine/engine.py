"""The engine: continuous batching of many requests over one NativeLM and a paged KV
cache, and the one engine per model that `decodekit.generate` and every front end run on.

    engine = engine_for(model)                                      # the model's own engine
    for delta in run_requests(model, requests): ...                 # add them, step to their end
    handle = engine.submit("ROMEO:", SamplingParams(n=4, seed=0))   # thread-safe
    engine.start()                                                  # or call engine.step()
    for delta in handle: ...                                        # or handle.result()

A step (`step`) is three calls. `_schedule`: admit waiting requests and reserve every
scheduled token's slot (scheduler.py, entry.py). `_run`: the programs' rounds on other
models (rounds.py), then one forward of this engine's model over every scheduled token
(batch.py), compiled when it only decodes and its bucket is ready (compile_policy.py; on a
GPU replayed from a CUDA graph, cuda_graphs.py).
`_postprocess`: the new sequences take RunningKV lanes, every sampling row gets one token
from its request's own chain and generator (request.py: `sample_rows`; entry.py
`finish_rows`) and every program ends its step (rounds.py `resume`), so a seeded request's
random stream is the same alone or beside others; with the model's `batch_invariant` on
(read when the engine is built) its logits are too, bit for bit, and so are its tokens
and logprobs. Requests join and leave between steps. A step that raises: failure.py.
Off the request's path: the server's background thread (background.py) and `stats`
(stats.py).

One persistent engine per model. `decodekit.generate`, `stream`, `LocalGenerator`, the
CLI and the server run a paged-KV model's requests (`LanguageModel.supports_paged_kv`:
NativeLM) on the engine `engine_for` returns: built on the model's first request with
`EngineConfig`'s memory bound, and kept for the model's life, so its prefix cache serves
later calls. A finished sequence leaves the full blocks of its prompt and generated tokens
in that cache (idle, evicted least recently used first when the pool runs out:
block_pool.py, prefix_cache.py), so a tree-search child, a refinement round or a retry
that extends an earlier text reuses its KV instead of prefilling it again. The record is
the model's own attribute `_decodekit_engine`, (engine, weights stamp), set only here,
under one lock: the engine references its model, so a module-level dict would keep every
model alive; an attribute makes a cycle the garbage collector frees with the model. The
engine is rebuilt when it no longer matches the model: the model's `batch_invariant` flag
(read when an engine is built), or its weights (a compressed-in-place or reloaded model
must not read KV its old weights computed: `weights_stamp`).

Threads: any number of callers may run requests on one engine at once (`run_requests`).
Each caller adds its requests and then drives `Engine.step` (serialised by the engine's
step lock) until its own requests finish; every step advances every caller's requests, so
concurrent calls batch together. A step that raises fails the requests it was running
(each of their callers gets the error), rolls back the KV slots it reserved and leaves the
engine usable, its prefix cache intact (`Engine.step`, failure.py); a KeyboardInterrupt in
`generate` is such a failure too.
"""
from __future__ import annotations

import itertools
import threading
import uuid
from collections import deque
from collections.abc import Iterator

import torch

from decodekit.engine import failure, rounds
from decodekit.engine.background import Background
from decodekit.engine.batch import build_batch, paged_forward
from decodekit.engine.block_pool import PoolCorrupted
from decodekit.engine.compile_policy import CompiledDecode, CompiledSpans, eligible
from decodekit.engine.compile_worker import STEPS
from decodekit.engine.config import EngineConfig
from decodekit.engine.entry import Entry, entry_for, finish_rows
from decodekit.engine.handle import EngineFull, Inbox, RequestHandle, wake
from decodekit.engine.members import Members
from decodekit.engine.program import Program
from decodekit.engine.scheduler import Scheduler, Step, Work
from decodekit.engine.stats import engine_stats
from decodekit.models.base import LanguageModel, weights_stamp
from decodekit.params import SamplingParams
from decodekit.request import Delta, Prompt, Request, make_requests, sample_rows

__all__ = ["DEFAULT_CONFIG", "Engine", "EngineFull", "RequestHandle", "engine_for", "forget_engine",
           "run_requests"]

_ATTRIBUTE = "_decodekit_engine"
_LOCK = threading.Lock()
# EngineConfig's KV bound; up to 1024 sequences per forward, so a `generate` call of many
# prompts x n samples runs them all in one batch, as the engine per call did (arith, 32
# prompts x 16 samples: 1.12 s, against 1.38 s at EngineConfig's default 64: BENCHMARKS.md).
DEFAULT_CONFIG = EngineConfig(max_running=1024)


class Engine:
    def __init__(self, model: LanguageModel, config: EngineConfig | None = None):
        if not model.supports_paged_kv:
            raise TypeError(
                f"the engine runs models that support paged KV (NativeLM), got {type(model).__name__}"
            )
        self.model = model
        self.config = config = config or EngineConfig()
        # The model's batch-invariant mode as it is now holds for this engine's life.
        self.batch_invariant = model.batch_invariant
        self.windows = model.config.layer_windows
        # The KV of each model requests run on (members.py): this engine's own, then others'.
        self.members = Members(model, config, share_prefixes=not (self.batch_invariant or self.windows))
        self.pool, self.running_kv = self.members.main.pool, self.members.main.running_kv
        self.scheduler = Scheduler(self.members, config)
        self.inbox = Inbox(config.max_waiting)
        self._step_lock = threading.Lock()
        self.background = Background(self.step, self.has_work, self.inbox.cond)  # background.py
        self.steps = 0
        self.generated_tokens = 0
        self.peak_blocks_used = 0
        self.resets = 0  # times a failed step left books that disagreed (failure.py)
        self._forward = paged_forward  # the eager forward of every step that is not all decoding
        # The compiled decode step (compile_policy.py), where this engine's model and modes allow it.
        self.compile_refused = eligible(model, self.pool, self.batch_invariant)
        self.compiled = None
        if config.compile is not False and self.compile_refused is None:
            self.compiled = CompiledDecode(model, config.compile)
        self.lanes = self.compiled.lanes if self.compiled is not None else None
        # Speculative verification steps compiled per span (compile_policy.py), on the CPU; a
        # sliding-window model's spans stay eager (each query would need its own window mask).
        self.spans = None
        if self.compiled is not None and model.device.type == "cpu" and not any(self.windows):
            self.spans = CompiledSpans(model, config.compile)

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
        entry.attach(self.model, self.members, self.config.block_size)
        for model in [self.model, *entry.models]:
            needed = entry.blocks_alone(model, self.config.block_size)
            total = self.members.of(model).pool.num_blocks
            if needed > total:
                raise ValueError(f"the request needs up to {needed} KV blocks of {model.name}"
                                 f"{entry.describe()}, more than the engine's {total}")  # fmt: skip
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        entry.handle = RequestHandle(request_id, entry.num_samples, lambda: self.inbox.cancel(entry))
        self.inbox.put(entry, len(self.scheduler.waiting))
        return entry.handle

    def has_work(self) -> bool:
        return bool(self.inbox or self.scheduler.has_work())

    # ------------------------------------------------------------------ stepping

    def step(self) -> None:
        """One iteration: admit, prefill, decode one token for every running sequence, and
        one step of every running program (program.py).

        A step that raises (a forward, an adapter, a program, an interrupt) fails the
        requests and programs it was running, after giving back every KV slot it reserved,
        so nothing it did not finish writing reaches the prefix cache; then it raises the
        error. Waiting requests stay queued and the engine stays usable (failure.py)."""
        if self.lanes is not None:
            self.lanes.poll()  # a compilation runs here, between steps (compile_worker.py)
        if self.spans is not None:
            self.spans.poll()
        self.members.poll()  # and the member models' (members.py)
        with STEPS.step(), self._step_lock, torch.inference_mode(), failure.failing_step(self):
            step = self._schedule()
            output = self._run(step)
            self._postprocess(step, output)

    def _schedule(self) -> Step:
        """The submitted requests queued and the cancelled ended (their blocks freed); the
        running sampling rows' slots, then admissions (scheduler.py)."""
        incoming, cancelled = self.inbox.take()
        self.scheduler.waiting.extend(incoming)
        for entry in cancelled:
            self._end(entry, entry.finals())
        self.scheduler.hold()
        step = self.scheduler.schedule()
        if step.work or step.programs:
            self.peak_blocks_used = max(self.peak_blocks_used, self.pool.num_used)
        return step

    def _run(self, step: Step) -> tuple | None:
        """The programs' rounds on other models, then one forward of this engine's model
        over the sampling work and the programs' feeds to it: (the forward's works in
        logits order, logits, final hidden states or None), or None without a forward."""
        step.parked = rounds.run_rounds(step.programs, self.model, self.members, self._end)
        step.feeds = [(entry, i, feed) for entry in step.parked for i, fw in enumerate(entry.forwards)
                      if fw.model is self.model for feed in fw.feeds]  # fmt: skip
        if not step.work and not step.feeds:
            return None
        manager = self.scheduler.manager
        step.feed_work = [Work(f.seq, f.seq.pending, manager.reserve(f.seq.table, f.seq.pending), f.every)
                          for _, _, f in step.feeds]  # fmt: skip
        works = step.work + step.feed_work
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

        def eager() -> tuple:
            items = [(w.seq.table, w.seq.tokens, w.slots) for w in ordered]
            batch = build_batch(self.pool, items, self.running_kv, self.windows, [w.every for w in ordered])
            out = self._forward(self.model, *batch, self.batch_invariant, wants_hidden)
            return out if wants_hidden else (out, None)

        only_decoding = len(ordered) == len(decoding) and not wants_hidden and not step.forks
        if only_decoding and self.compiled is not None:
            return ordered, *self.compiled.forward(decoding, self.running_kv, self.pool, eager)
        verifying = not step.work and not wants_hidden and not step.forks and CompiledSpans.verifies(ordered)
        if verifying and self.spans is not None:  # a speculative verification alone (compile_policy.py)
            return ordered, *self.spans.forward(ordered, self.pool, eager)
        return ordered, *eager()

    def _postprocess(self, step: Step, output: tuple | None) -> None:
        """After the forward: its blocks registered in the prefix cache, the new sequences'
        lanes, one token sampled for every sampling row, and the programs' steps ended."""
        if output is not None:
            ordered, logits, hidden = output
            sizes = [w.count if w.every else 1 for w in ordered]
            ends = dict(zip(map(id, ordered), itertools.accumulate(sizes), strict=True))
            by_work = dict(zip(map(id, ordered), logits.split(sizes), strict=True)) if step.feed_work else {}
            manager = self.scheduler.manager
            for work in step.work + step.feed_work:
                manager.register(work.seq.table, work.seq.tokens, work.seq.table.length)
            self.scheduler.start_decoding(step)
            for _, _, feed in step.feeds:
                seq = feed.seq
                if feed.lane and seq.lane is None:
                    seq.lane = self.running_kv.add(seq, seq.table.blocks, seq.table.length)
            self.steps += 1
            if step.rows:
                kept = [ends[id(step.work[i])] - 1 for i in step.logit_rows]
                if kept != list(range(len(logits))):  # a decode-only step keeps every row, in order
                    logits, hidden = logits[kept], None if hidden is None else hidden[kept]
                sample_rows(logits, step.rows, hidden)  # [R, V]: one token per row
                self.generated_tokens += len(step.rows)
                wake(finish_rows(step, self.model.max_context, self.scheduler.remove))
            for (entry, i, _), work in zip(step.feeds, step.feed_work, strict=True):
                entry.results[i].append(by_work[id(work)])
            sampled = [(feed.row, by_work[id(work)]) for (_, _, feed), work in zip(step.feeds, step.feed_work)
                       if feed.row is not None]  # fmt: skip
            if sampled:  # programs' rows that decode plainly: one batch, as the sampling rows
                sample_rows(torch.cat([out[-1:] for _, out in sampled]), [row for row, _ in sampled])
                self.generated_tokens += len(sampled)
        for entry in step.parked:
            rounds.resume(entry, self._end)

    def _end(self, entry: Entry, deltas, error: BaseException | None = None) -> None:
        """Take a request or program out of the engine, its KV freed (what it computed stays
        in the prefix cache), and hand its last deltas (or `error`) to its reader; the member
        pools no entry uses any more become idle (members.py)."""
        self.scheduler.remove(entry)
        if entry.models:
            entries = [*self.scheduler.running, *self.scheduler.waiting]
            in_use = [m for e in entries for m in e.models] + [s.model for e in entries for s in e.seqs]
            self.members.retire(in_use)
        wake(entry.handle._push(deltas, finished=True, error=error))

    def check(self) -> None:
        """Raise `PoolCorrupted` unless every pool's reference counts equal the blocks that
        live sequences hold and every RunningKV lane belongs to the sequence that names it.
        Cheap next to a forward, but not free: called after a failed step, and by tests."""
        with self._step_lock:
            failure.check_books(self.members, self.scheduler)

    def take_incoming(self) -> None:
        """Queue the submitted requests and drop the cancelled ones (freeing their blocks)."""
        with self._step_lock:
            incoming, cancelled = self.inbox.take()
            self.scheduler.waiting.extend(incoming)
            for entry in cancelled:
                self._end(entry, entry.finals())

    def fail_all(self, error: BaseException) -> None:
        """End every queued and running request with `error` (waits for a running step)."""
        with self._step_lock:
            failure.fail_all(self, error)

    def start(self) -> None:
        """Step in a background thread whenever there is work (background.py); each `start`
        is undone by one `stop`."""
        self.background.start()

    def stop(self) -> None:
        """Stop the background thread after its step, once every `start` has had its `stop`
        (queued requests stay)."""
        self.background.stop()

    def stats(self) -> dict:
        """The engine's state for /health and /metrics (stats.py)."""
        return engine_stats(self)


# ---------------------------------------------------------------------- one engine per model


def engine_for(model: LanguageModel, config: EngineConfig | None = None) -> Engine:
    """The model's persistent engine, built on first use (thread-safe).

    config: the bound of a new engine (default `DEFAULT_CONFIG`); an engine built with
    another config is replaced by one with this config (its callers keep the old one).
    """
    with _LOCK:
        engine, built_on = model.__dict__.get(_ATTRIBUTE, (None, None))
        stamp = weights_stamp(model)
        if (
            engine is None
            or engine.model is not model  # a copy of a model that had an engine
            or engine.batch_invariant != model.batch_invariant
            or built_on != stamp
            or (config is not None and engine.config != config)
        ):
            engine = Engine(model, config or DEFAULT_CONFIG)
            model.__dict__[_ATTRIBUTE] = (engine, stamp)
        return engine


def forget_engine(model: LanguageModel, engine: Engine | None = None) -> None:
    """Drop the model's engine (only if it is still `engine`, when given): the next call
    builds a fresh one with an empty cache. Callers still running on it finish there."""
    with _LOCK:
        current = model.__dict__.get(_ATTRIBUTE, (None,))[0]
        if current is not None and (engine is None or current is engine):
            del model.__dict__[_ATTRIBUTE]


def run_requests(model: LanguageModel, requests: list[Request | Program]) -> Iterator[Delta]:
    """Run `requests` (sampling requests or programs: program.py) on the model's persistent
    engine, yielding their deltas as they come.

    Requests larger than the engine's whole pool run on a private engine sized for them.
    Closing the iterator early cancels the requests it has not finished.
    """
    engine = engine_for(model)
    if any(entry_for(r).blocks_alone(model, engine.config.block_size) > engine.pool.num_blocks
           for r in requests):  # fmt: skip
        engine = _private_engine(model, requests)
    pending = deque(requests)
    handles: list[RequestHandle] = []
    try:
        while True:
            while pending:  # as many as the queue takes (max_waiting)
                try:
                    handles.append(engine.add(pending[0]))
                except EngineFull:
                    break
                pending.popleft()
            # `done` is set with a request's last delta, so read it before polling.
            finished = not pending and all(handle.done for handle in handles)
            for handle in handles:
                yield from handle.poll()
            if finished:
                break
            engine.step()  # a step that raises has failed its own requests: `Engine.step`
        for handle in handles:
            handle.result()  # raises the error of a step that failed in another thread
    finally:
        unfinished = [handle for handle in handles if not handle.done]
        for handle in unfinished:
            handle.cancel()
        if unfinished:
            engine.take_incoming()  # free their blocks now, not at some later caller's step


def _private_engine(model: LanguageModel, requests: list[Request | Program]) -> Engine:
    """An engine sized for exactly these requests (the pre-persistent path)."""
    size = EngineConfig.block_size
    entries = [entry_for(r) for r in requests]
    blocks = sum(entry.blocks_alone(model, size) for entry in entries)
    rows = sum(entry.num_samples for entry in entries)
    return Engine(model, EngineConfig(num_blocks=blocks, max_running=max(rows, 1),
                                      max_waiting=len(requests)))  # fmt: skip
