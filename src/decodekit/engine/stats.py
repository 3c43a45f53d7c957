"""What `Engine.stats()` reports, for the server's /health and /metrics (server/metrics.py)
and the benchmarks: requests (sampling requests and programs alike), the engine's pool,
every member pool (drafts, amateurs: members.py), the step counters and the buckets being
compiled. It only reads the engine; nothing on a request's path calls it.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from decodekit.engine.block_pool import BlockPool

if TYPE_CHECKING:
    from decodekit.engine.engine import Engine


def engine_stats(engine: Engine) -> dict:
    """The engine's state: requests, its pool's blocks, and every member pool's."""
    pool, scheduler, members = engine.pool, engine.scheduler, engine.members
    queued = [*engine.inbox.incoming, *scheduler.waiting]
    return {
        "running_requests": len(scheduler.running),
        "running_sequences": sum(len(e.seqs) for e in scheduler.running),
        "waiting_requests": len(queued),
        **_blocks(pool),
        "free_blocks": pool.num_free,
        "idle_cached_blocks": pool.cache.num_idle if pool.cache is not None else 0,
        "running_programs": Counter(e.kind for e in scheduler.running)["program"],
        "waiting_programs": Counter(e.kind for e in queued)["program"],
        "members": {
            model_kv.model.name: _pool_stats(model_kv.pool, members.is_idle(model_kv))
            for model_kv in members
            if model_kv.pool is not pool
        },  # fmt: skip
        "peak_used_blocks": engine.peak_blocks_used,
        "block_bytes": pool.bytes_per_block,
        "running_rows_bytes": engine.running_kv.nbytes,
        "prefill_tokens": scheduler.prefill_tokens,
        "prefix_cache_hit_tokens": scheduler.cached_tokens,
        "preemptions": scheduler.preemptions,
        "steps": engine.steps,
        "generated_tokens": engine.generated_tokens,
        "resets": engine.resets,
        # the buckets a compile worker or the next step compiles (compile_worker.py): the
        # CPU a server uses while no request runs
        "compiling": _compiling(engine),
    }


def _compiling(engine: Engine) -> list[str]:
    """The buckets being compiled: the engine model's decode steps, its verification steps
    (`verify=T/...`) and its member models' decode steps (`<name>/...`)."""
    names = list(engine.lanes.compiling) if engine.lanes is not None else []
    if engine.spans is not None:
        names += [f"verify={span}/{name}" for span, step in engine.spans.by_span.items()
                  for name in step.lanes.compiling]  # fmt: skip
    members = [kv for kv in engine.members if kv.compiled is not None and kv is not engine.members.main]
    names += [f"{kv.model.name}/{name}" for kv in members for name in kv.compiled.lanes.compiling]
    return names


def _pool_stats(pool: BlockPool, idle: bool) -> dict:
    """A member pool's blocks and bytes."""
    return {**_blocks(pool), "bytes": pool.nbytes, "idle": idle}


def _blocks(pool: BlockPool) -> dict:
    """A pool's blocks: in all, in use, held by running programs, in the prefix cache."""
    return {
        "total_blocks": pool.num_blocks,
        "used_blocks": pool.num_used,
        "held_blocks": pool.held,
        "cached_blocks": len(pool.cache) if pool.cache is not None else 0,
    }
