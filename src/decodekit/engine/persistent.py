"""One persistent engine per model: `engine_for(model)` and `run_requests`.

`decodekit.generate`, `stream`, `LocalGenerator`, the CLI and the server run a paged-KV
model's requests on the engine `engine_for` returns: built on the model's first request
with `EngineConfig`'s memory bound, and kept for the model's life, so its prefix cache
serves later calls. A finished sequence leaves the full blocks of its prompt and generated
tokens in that cache (idle, evicted least recently used first when the pool runs out: block_pool.py,
prefix_cache.py), so a tree-search child, a refinement round or a retry that extends an
earlier text reuses its KV instead of prefilling it again.

The record is the model's own attribute `_decodekit_engine`, (engine, weights stamp),
set only here, under one lock: the engine references its model, so a module-level dict
would keep every model alive; an attribute makes a cycle the garbage collector frees with
the model. The engine is rebuilt when it no longer matches the model: the model's `batch_invariant` flag (read
when an engine is built), or its weights (a compressed-in-place or reloaded model must not
read KV its old weights computed: `weights_stamp`).

Threads: any number of callers may run requests on one engine at once. Each caller adds
its requests and then drives `Engine.step` (serialised by the engine's step lock) until its
own requests finish; every step advances every caller's requests, so concurrent calls
batch together. A step that raises fails the requests it was running (each of their callers
gets the error), rolls back the KV slots it reserved and leaves the engine usable, its
prefix cache intact (engine.py `Engine.step`, failure.py); a KeyboardInterrupt in `generate` is such a
failure too.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator

from decodekit.engine.config import EngineConfig
from decodekit.engine.engine import Engine, EngineFull, RequestHandle
from decodekit.engine.entry import entry_for
from decodekit.engine.program import Program
from decodekit.models.base import LanguageModel, weights_stamp
from decodekit.request import Delta, Request

_ATTRIBUTE = "_decodekit_engine"
_LOCK = threading.Lock()
# EngineConfig's KV bound; up to 1024 sequences per forward, so a `generate` call of many
# prompts x n samples runs them all in one batch, as the engine per call did (arith, 32
# prompts x 16 samples: 1.12 s, against 1.38 s at EngineConfig's default 64: BENCHMARKS.md).
DEFAULT_CONFIG = EngineConfig(max_running=1024)


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
            engine.step()  # a step that raises has failed its own requests: engine.py
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
