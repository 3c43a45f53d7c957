"""The engine: continuous batching of many requests over one NativeLM and a paged KV cache.

    engine = Engine(model, EngineConfig(max_kv_bytes=256 * 2**20))
    handle = engine.submit("ROMEO:", SamplingParams(n=4, seed=0))   # thread-safe
    engine.start()                                                   # or call engine.step()
    for delta in handle: ...                                         # or handle.result()

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
`decodekit.generate` runs models that support paged KV (`LanguageModel.supports_paged_kv`:
NativeLM) on the model's persistent engine (persistent.py: `engine_for`, `run_requests`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import uuid
from collections import Counter

import torch

from decodekit.engine import failure, rounds
from decodekit.engine.batch import build_batch, paged_forward
from decodekit.engine.block_pool import BlockPool, PoolCorrupted
from decodekit.engine.compile_policy import CompiledDecode, CompiledSpans, eligible
from decodekit.engine.compile_worker import STEPS
from decodekit.engine.config import EngineConfig
from decodekit.engine.entry import Entry, entry_for, finish_rows
from decodekit.engine.handle import EngineFull, Inbox, RequestHandle, wake
from decodekit.engine.members import Members
from decodekit.engine.program import Program
from decodekit.engine.scheduler import Scheduler, Step, Work
from decodekit.models.base import LanguageModel
from decodekit.params import SamplingParams
from decodekit.request import Prompt, Request, make_requests, sample_rows

__all__ = ["Engine", "EngineFull", "RequestHandle"]

_log = logging.getLogger(__name__)


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
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._starts = 0  # `start` calls not yet undone by `stop`
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
        # Speculative verification steps compiled per span (compile_policy.py), on the CPU.
        self.spans = None
        if self.compiled is not None and model.device.type == "cpu":
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

    def _compiling(self) -> list[str]:
        """The buckets being compiled: this model's decode steps, its verification steps
        (`verify=T/...`) and its member models' decode steps (`<name>/...`)."""
        names = list(self.lanes.compiling) if self.lanes is not None else []
        if self.spans is not None:
            names += [f"verify={span}/{name}" for span, step in self.spans.by_span.items()
                      for name in step.lanes.compiling]  # fmt: skip
        members = [kv for kv in self.members if kv.compiled is not None and kv is not self.members.main]
        names += [f"{kv.model.name}/{name}" for kv in members for name in kv.compiled.lanes.compiling]
        return names

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

    # ------------------------------------------------------------------ background thread

    def start(self) -> None:
        """Run `step` in a background thread whenever there is work. Each `start` is undone
        by one `stop`: two servers on one model's shared engine (persistent.py) keep it running
        until both stop."""
        with self.inbox.cond:
            self._starts += 1
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = False
            self._thread = threading.Thread(target=_loop, args=(self,), name="decodekit-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the background thread after its current step (queued requests stay), once
        every `start` has had its `stop`."""
        with self.inbox.cond:
            self._starts = max(self._starts - 1, 0)
            if self._starts:
                return
            self._stopping = True
            self.inbox.cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        self._thread = None

    def fail_all(self, error: BaseException) -> None:
        """End every queued and running request with `error` (waits for a running step)."""
        with self._step_lock:
            failure.fail_all(self, error)

    def stats(self) -> dict:
        """The engine's state: requests (sampling requests and programs alike), its pool's
        blocks, and every member pool's (drafts, amateurs), for /health and /metrics."""
        pool, scheduler = self.pool, self.scheduler
        cached = len(pool.cache) if pool.cache is not None else 0
        queued = [*self.inbox.incoming, *scheduler.waiting]
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
            "running_programs": Counter(e.kind for e in scheduler.running)["program"],
            "waiting_programs": Counter(e.kind for e in queued)["program"],
            "members": {
                model_kv.model.name: _pool_stats(model_kv.pool, self.members.is_idle(model_kv))
                for model_kv in self.members
                if model_kv.pool is not pool
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
            "compiling": self._compiling(),
        }


def _loop(engine: Engine) -> None:
    """The background thread's: step whenever there is work, until `stop`."""
    while True:
        with engine.inbox.cond:
            engine.inbox.cond.wait_for(lambda: engine._stopping or engine.has_work())
            if engine._stopping:
                return
        try:
            engine.step()
        except Exception as error:  # noqa: BLE001 -- the step failed its own requests
            _log.warning("an engine step failed and ended its requests: %r", error)


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
