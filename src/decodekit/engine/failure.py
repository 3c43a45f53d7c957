"""A step that raises: what it fails, what it rolls back, and when the engine starts over.

`Engine.step` runs inside `failing_step`. When the step raises (a forward, an adapter, a
program, an interrupt):

1. every slot it reserved is given back (block_pool.py `rollback`: a position reserved but not
   written must never be registered in the prefix cache nor read by anyone), before anything
   it touched can become shared;
2. the entries it was running fail with the error, and so does the one it was admitting,
   if the error came with an admission. Waiting requests go on: they run in later steps.
   Only an error that no entry can be blamed for (the engine's own state: scheduling, its
   books) fails the waiting ones too, so a step that would fail again is not retried forever;
3. the pools' books are checked (`check_books`); books that disagree (an interrupt between
   two updates) cost the KV, not correctness: the engine starts over with empty pools
   (`reset`).

Then the step raises the error, and the engine stays usable.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from decodekit.engine.block_pool import PoolCorrupted
from decodekit.engine.members import Members
from decodekit.engine.scheduler import Scheduler

if TYPE_CHECKING:
    from decodekit.engine.engine import Engine

_log = logging.getLogger(__name__)


@contextmanager
def failing_step(engine: Engine) -> Iterator[None]:
    """Journal the step's reservations in every pool; on an error, fail what it ran."""
    engine.members.journal(True)
    try:
        yield
    except BaseException as error:
        fail_step(engine, error)
        raise
    finally:
        engine.members.journal(False)


def fail_step(engine: Engine, error: BaseException) -> None:
    """Steps 1-3 of the module docstring."""
    scheduler = engine.scheduler
    engine.members.rollback()
    blamed = list(scheduler.running)
    if scheduler.admitting is not None and scheduler.admitting not in blamed:
        blamed.append(scheduler.admitting)
    scheduler.admitting = None
    if not blamed:
        blamed = [*engine.inbox.take()[0], *scheduler.waiting]  # the engine's own state
    for entry in blamed:
        engine._end(entry, [], error)
    try:
        check_books(engine.members, scheduler)
    except PoolCorrupted as problem:
        _log.warning("%s after a failed step: the engine starts over with empty pools", problem)
        reset(engine)


def fail_all(engine: Engine, error: BaseException) -> None:
    """End every running and queued request with `error`."""
    for entry in [*engine.scheduler.running, *engine.inbox.take()[0], *engine.scheduler.waiting]:
        engine._end(entry, [], error)


def check_books(members: Members, scheduler: Scheduler) -> None:
    """Raise `PoolCorrupted` unless every pool's reference counts equal the blocks that live
    sequences hold and every RunningKV lane belongs to the sequence that names it."""
    tables: dict[int, list] = {id(model_kv.pool): [] for model_kv in members}
    laned = []
    for entry in [*scheduler.running, *scheduler.waiting]:
        for seq in entry.seqs:
            if id(seq.model_kv.pool) not in tables:
                raise PoolCorrupted(f"a request holds blocks of {seq.model.name}, "
                                    "whose pool the engine no longer has")  # fmt: skip
            tables[id(seq.model_kv.pool)].append(seq.table)
            laned += [seq] if seq.lane is not None else []
    for model_kv in members:
        model_kv.pool.check(tables[id(model_kv.pool)])
    owners = members.main.running_kv.owners
    if len(laned) != len(owners) or any(owners[seq.lane] is not seq for seq in laned):
        raise PoolCorrupted(f"{len(owners)} RunningKV rows for {len(laned)} sequences with lanes")


def reset(engine: Engine) -> None:
    """Empty pools, lanes and member pools (the running requests have been failed)."""
    engine.members.reset(engine.model, engine.running_kv.share_prefixes)
    engine.pool, engine.running_kv = engine.members.main.pool, engine.members.main.running_kv
    if engine.compiled is not None:
        engine.compiled.prefix_kv = None
    engine.resets += 1
