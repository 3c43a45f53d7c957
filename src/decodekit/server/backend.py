"""The server's one seam to the library: served models, their engines, and jobs.

`Backend.submit(name, run)` starts a request the library built and routed (a strategy's
`prepare`, decode/sample.py `Run`; request_plan.py `launch`) and returns a `Job` (the engine's
`RequestHandle`, or a `ThreadJob`), which the HTTP layer reads with `aiter()` (or
`abatches()`: what arrived together, e.g. one engine step's deltas) and ends early with `cancel()`:

- whatever the library routes to the served model's own engine runs there: sampling
  (greedy, adapted, constrained), beam search, speculative decoding, and contrastive
  decoding and beam search over a ContrastiveLM of two served paged-KV models (the
  expert's engine, the amateur in a member pool). The engine batches every request and
  program continuously over paged KV (engine/engine.py), and a cancelled one frees its
  KV blocks at the next step;
- the rest (models without paged KV: the Hugging Face fallback, k-gram; a contrastive
  amateur with a window) runs the library's plain loop in one worker thread, one job at a
  time. Its cancellation takes effect between deltas (beam and speculative search produce
  their text at the end, so a cancelled one finishes its search first).

Each model queues at most `max_queued` requests; beyond that `submit` raises `QueueFull`
(the HTTP layer answers 503 with Retry-After).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from decodekit.decode.sample import Run, runs_on_own_engine
from decodekit.models.base import LanguageModel
from decodekit.request import Delta


@dataclass(frozen=True)
class ServerConfig:
    """Bounds of the server (docs/server.md), validated on construction.

    max_tokens: the most tokens one request may ask for (max_tokens above it: 400).
    max_n: the most samples per prompt (n, best_of, num_beams above it: 400).
    max_queued: requests queued per model before 503. request_timeout: seconds a request
    may take (then 504, or an error event in a stream). max_running: sequences an engine
    decodes per step. kv_bytes: each engine's KV memory bound (None: the device's, 256 MiB on
    the CPU and 40 % of a GPU's free memory: engine/config.py `kv_bytes_for`). reward_models:
    scorers a request may name (`scorer`), loaded on first use. Access (server/guard.py): api_key (None: no
    key), max_body_bytes (larger bodies: 413), allowed_hosts (`Host` names accepted besides
    the loopback ones; "*": any), cors_origins (browser origins allowed; none by default).
    What real clients send (as vLLM takes it): a body key the server does not know is ignored,
    logged and named in the answer's `X-Ignored-Fields` header (strict_fields: a 400, as
    OpenAI answers); a max_tokens beyond the context left after the prompt is shortened to
    fit, the answer then ending with finish_reason "length" (strict_max_tokens: a 400).
    truncate_prompts: a prompt that does not fit the context keeps its last context - 1 tokens
    (one left to generate), named in the answer's `X-Prompt-Tokens-Dropped` header; without it,
    a 400 (a request's own `truncate_prompt_tokens` applies either way).
    """

    max_tokens: int = 2048
    max_n: int = 64
    max_queued: int = 256
    request_timeout: float = 600.0
    max_running: int = 64
    kv_bytes: int | None = None
    retry_after: int = 1
    reward_models: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)
    max_body_bytes: int = 8 * 2**20
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    strict_fields: bool = False
    strict_max_tokens: bool = False
    truncate_prompts: bool = False

    def __post_init__(self):
        for name in ("max_tokens", "max_n", "max_queued", "max_running", "kv_bytes", "retry_after",
                     "max_body_bytes"):
            value = getattr(self, name)
            if name == "kv_bytes" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        timeout = self.request_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"request_timeout must be a number of seconds > 0, got {timeout!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ValueError("api_key must be a non-empty string or None")


class QueueFull(RuntimeError):
    """More than `max_queued` requests wait for a model."""


class Job(Protocol):
    request_id: str

    @property
    def done(self) -> bool: ...

    def cancel(self) -> None: ...

    def aiter(self) -> AsyncIterator[Delta]: ...

    def abatches(self) -> AsyncIterator[list[Delta]]: ...


_END = object()


class ThreadJob:
    """Deltas produced by `run()` in the backend's worker thread, read from an event loop."""

    def __init__(self, request_id: str, run: Callable[[], Iterator[Delta]], loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._run = run
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        self._cancelled.set()

    def work(self) -> None:
        """The worker thread's part: run, handing each delta (or the error) to the loop."""
        try:
            if not self._cancelled.is_set():
                for delta in self._run():
                    self._loop.call_soon_threadsafe(self._queue.put_nowait, delta)
                    if self._cancelled.is_set():
                        break
        except Exception as error:  # noqa: BLE001 -- handed to the reader, which reports it
            self._loop.call_soon_threadsafe(self._queue.put_nowait, error)
        finally:
            self._done = True
            self._loop.call_soon_threadsafe(self._queue.put_nowait, _END)

    async def aiter(self) -> AsyncIterator[Delta]:
        async for batch in self.abatches():
            for delta in batch:
                yield delta

    async def abatches(self) -> AsyncIterator[list[Delta]]:
        """The deltas that arrived since the last read, together (as RequestHandle.abatches)."""
        while True:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            batch = []
            for item in items:
                if item is _END or isinstance(item, BaseException):
                    if batch:
                        yield batch
                    if item is _END:
                        return
                    raise item
                batch.append(item)
            yield batch


class Backend:
    """Served models by name, an engine for each model with paged KV, a worker thread for the rest.
    `aliases` are other ids a request may name a served model by (a directory's full path);
    `chat_templates` (served name -> Jinja text, `serve --chat-template`) replace the models'
    own chat templates."""

    def __init__(self, models: dict[str, LanguageModel], config: ServerConfig | None = None,
                 aliases: dict[str, str] | None = None, chat_templates: dict[str, str] | None = None):
        from decodekit.engine.config import EngineConfig
        from decodekit.engine.engine import engine_for

        if not models:
            raise ValueError("a server needs at least one model")
        self.models = dict(models)
        self.aliases = {alias: name for alias, name in (aliases or {}).items() if alias not in self.models}
        unknown = sorted(set(self.aliases.values()) - set(self.models))
        if unknown:
            raise ValueError(f"aliases name models that are not served: {unknown}")
        self.chat_templates = dict(chat_templates or {})
        unknown = sorted(set(self.chat_templates) - set(self.models))
        if unknown:
            raise ValueError(f"chat templates name models that are not served: {unknown}; served: "
                             f"{sorted(self.models)}")
        self.config = config = config or ServerConfig()
        self.engine_config = engine_config = EngineConfig(
            max_kv_bytes=config.kv_bytes, max_running=config.max_running, max_waiting=config.max_queued)
        # The model's persistent engine (engine/engine.py `engine_for`), with the server's bound: the
        # server's requests and any `decodekit.generate` call in this process share its cache.
        # Read through `engine(name)`, which follows the model when its engine is replaced.
        self.engines = {name: engine_for(model, engine_config) for name, model in self.models.items()
                        if runs_on_own_engine(model)}
        self._retired: list = []  # replaced engines still finishing their requests
        self._started = False
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decodekit-worker")
        self._thread_jobs = 0  # submitted to the worker and not yet finished
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._scorers = {name: reward_scorer(name) for name in config.reward_models}
        self.counters = {"requests": 0, "generated_tokens": 0, "cancelled": 0, "timed_out": 0, "rejected": 0}

    def served_name(self, name: str) -> str | None:
        """The served model a request's `name` means (its own name or an alias), or None."""
        return name if name in self.models else self.aliases.get(name)

    def start(self) -> None:
        self._started = True
        for engine in self.engines.values():
            engine.start()

    def stop(self) -> None:
        self._started = False
        for engine in [*self.engines.values(), *self._retired]:
            engine.stop()
        self._retired.clear()
        self.worker.shutdown(wait=False, cancel_futures=True)

    def engine(self, name: str):
        """The model's current persistent engine (`engine_for` with the server's bound). When
        it was replaced (the model's weights or batch-invariant flag changed, or another
        caller asked for another config), the new one is started here, so the server never
        serves from a stale one; a replaced engine is stopped once it has finished the
        requests it holds."""
        from decodekit.engine.engine import engine_for

        engine = engine_for(self.models[name], self.engine_config)
        with self._lock:
            current = self.engines[name]
            if engine is not current:
                self.engines[name] = engine
                if self._started:
                    engine.start()
                    self._retired.append(current)
            drained = [old for old in self._retired if not old.has_work()]
            self._retired = [old for old in self._retired if old not in drained]
        for old in drained:
            old.stop()
        return engine

    def submit(self, name: str, run: Run) -> Job:
        """A built request (its one prompt): on the served model's engine when the library
        routes it there, batched with every other request (a sampling request or a program,
        engine/program.py); otherwise its deltas, wherever they run, in the worker thread."""
        from decodekit.engine.engine import EngineFull

        if run.route is None or run.route[0] is not self.models[name] or name not in self.engines:
            return self.submit_thread(run.deltas)
        [entry] = run.route[1]
        try:
            return self.engine(name).add(entry, f"req-{next(self._ids)}")
        except EngineFull as error:
            raise QueueFull(str(error)) from None

    def submit_thread(self, run: Callable[[], Iterator[Delta]]) -> Job:
        """Any other generation: `run` in the worker thread (one job at a time)."""
        with self._lock:
            if self._thread_jobs >= self.config.max_queued:
                raise QueueFull(f"{self._thread_jobs} jobs are waiting (max_queued={self.config.max_queued})")
            self._thread_jobs += 1
        job = ThreadJob(f"req-{next(self._ids)}", run, asyncio.get_running_loop())

        def work():
            try:
                job.work()
            finally:
                with self._lock:
                    self._thread_jobs -= 1

        self.worker.submit(work)
        return job

    async def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in a thread of the event loop's pool (scoring, prompt log-probs)."""
        return await asyncio.to_thread(fn, *args)

    def scorer(self, name: str) -> Callable[[str, str], float] | None:
        """A reward model named on the command line (loaded at start), or None."""
        return self._scorers.get(name)

    def stats(self) -> dict:
        return {
            "models": {name: self.engine(name).stats() if name in self.engines else {"engine": None}
                       for name in self.models},
            "worker_jobs": self._thread_jobs,
            **self.counters,
        }


def reward_scorer(name: str) -> Callable[[str, str], float]:
    """A reward model (meta/rewards.py: a probe or a Hugging Face ORM/PRM) as (prompt, text)
    -> score, the whole text one segment; `score_kind` says what the score is."""
    from decodekit.meta.rewards import load_reward_model

    model = load_reward_model(name)

    def score(prompt: str, text: str) -> float:
        return model.score_segments(prompt, [text])[0]

    score.score_kind = model.score_kind
    return score
