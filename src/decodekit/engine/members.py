"""The engine's KV per model, and how long each lives: `ModelKV`, `Members`.

The engine's own model has its pool (and RunningKV) for the engine's life. A program's other
models (a draft, an amateur: program.py) get a pool of their own on first use, with the
engine's block size and memory bound. Such a pool belongs to the programs that use it: when
no queued or running program does, it becomes idle, and idle pools beyond
`EngineConfig.idle_member_bytes` of KV storage are freed, least recently used first (a
self-int4 draft's copy of the model goes with its pool).

A member model on the CPU gets the compiled decode step the engine's own model gets
(compile_policy.py `CompiledDecode`, under the engine's `compile` mode): its forwards that
feed one token per sequence run it over rows gathered from its pool (rows.py
`GatheredRows`). On a GPU they stay eager: a CUDA graph replays fixed storage, and gathered
rows are new tensors every step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

import torch

from decodekit.engine.block_pool import BlockManager, BlockPool, block_bytes
from decodekit.engine.compile_policy import CompiledDecode, eligible
from decodekit.engine.config import EngineConfig
from decodekit.engine.prefix_cache import PrefixCache
from decodekit.engine.rows import RunningKV
from decodekit.models.base import LanguageModel


class ModelKV:
    """One model's KV on an engine: its pool and table operations (and, for the engine's
    own model, its RunningKV)."""

    def __init__(self, model: LanguageModel, pool: BlockPool, running_kv: RunningKV | None = None):
        self.model = model
        self.pool = pool
        self.manager = BlockManager(pool)
        self.running_kv = running_kv
        self.compiled: CompiledDecode | None = None  # a member's one-token forwards (module docstring)
        # What the programs on this engine share, by keys of their own (program.py `ProgramKV.shared`).
        self.shared: dict = {}

    def close(self, seq) -> None:
        """Free a sequence's (program.py `Seq`) blocks and lane; its computed KV stays
        findable in the prefix cache (and its tokens stay, for a preempted sequence to
        recompute)."""
        computed = seq.tokens[: seq.table.length]
        self.manager.register(seq.table, computed, seq.table.length)
        self.manager.register_last(seq.table, computed)
        self.manager.free(seq.table)
        if seq.lane is not None:
            self.running_kv.leave(seq)


class Members:
    """The engine's `ModelKV` per model: `main` (the engine's model) and the programs' other
    models, built on first use (`of`), retired when idle (`retire`)."""

    def __init__(self, model: LanguageModel, config: EngineConfig, share_prefixes: bool):
        self.config = config
        self._models: dict[int, ModelKV] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # unused, least recent first
        self.journaling = False  # a step runs: new pools journal their tables too (block_pool.py)
        self.reset(model, share_prefixes)

    def reset(self, model: LanguageModel, share_prefixes: bool) -> None:
        """Only the engine's model, with an empty pool and no lanes (after a failed step left
        books that disagree: failure.py)."""
        pool = new_pool(model, self.config)
        with torch.inference_mode():  # as it is regrown in steps (a compiled step's guards see one kind)
            running_kv = RunningKV(pool, share_prefixes=share_prefixes)
        self.main = ModelKV(model, pool, running_kv)
        self._models.clear()
        self._models[id(model)] = self.main
        self._idle.clear()

    def of(self, model: LanguageModel) -> ModelKV:
        """The KV of `model` on this engine, built on first use (no longer idle)."""
        kv = self._models.get(id(model))
        self._idle.pop(id(model), None)
        if kv is None:
            if not model.supports_paged_kv:
                raise TypeError(f"a program's models must support paged KV, got {type(model).__name__}")
            if getattr(model, "dtype", None) is None or not hasattr(model, "config"):
                raise TypeError(f"{model.name} has no paged-KV configuration")
            kv = ModelKV(model, new_pool(model, self.config))
            kv.pool.journal = {} if self.journaling else None
            if (self.config.compile is not False and model.device.type == "cpu"
                    and eligible(model, kv.pool, model.batch_invariant) is None):  # fmt: skip
                kv.compiled = CompiledDecode(model, self.config.compile)
            self._models[id(model)] = kv
        return kv

    def __contains__(self, model: LanguageModel) -> bool:
        return id(model) in self._models

    def __len__(self) -> int:
        return len(self._models)

    def __iter__(self) -> Iterator[ModelKV]:
        return iter(list(self._models.values()))

    def poll(self) -> None:
        """Between steps: the members' compiled steps that are due compile (lanes.py `poll`)."""
        for kv in self._models.values():
            if kv.compiled is not None and kv is not self.main:
                kv.compiled.lanes.poll()

    def is_idle(self, kv: ModelKV) -> bool:
        return id(kv.model) in self._idle

    def journal(self, on: bool) -> None:
        """Start (or stop) recording the tables a step grows, for `rollback` (block_pool.py)."""
        self.journaling = on
        for kv in self._models.values():
            kv.pool.journal = {} if on else None

    def rollback(self) -> None:
        """Give back every slot the failed step reserved, in every pool."""
        for kv in self._models.values():
            kv.manager.rollback()

    def retire(self, in_use: Iterable[LanguageModel]) -> None:
        """The pools of models not `in_use` become idle; idle ones beyond
        `idle_member_bytes` are freed, least recently used first."""
        used = {id(self.main.model)} | {id(model) for model in in_use}
        for key in self._models:
            if key not in used and key not in self._idle:
                self._idle[key] = None
        idle_bytes = sum(self._models[key].pool.nbytes for key in self._idle)
        while idle_bytes > self.config.idle_member_bytes:
            key, _ = self._idle.popitem(last=False)
            idle_bytes -= self._models.pop(key).pool.nbytes


def new_pool(model, config: EngineConfig) -> BlockPool:
    """A block pool for `model`'s KV within `config`'s bound."""
    c = model.config
    kv_dtype = getattr(torch, config.kv_dtype) if config.kv_dtype else model.dtype
    bytes_per_block = block_bytes(c.num_layers, config.block_size, c.num_kv_heads, c.head_dim, kv_dtype)
    return BlockPool(
        c.num_layers,
        config.num_blocks_for(bytes_per_block, model.device),
        config.block_size,
        c.num_kv_heads,
        c.head_dim,
        model.dtype,
        PrefixCache() if config.prefix_caching else None,
        device=model.device,
        kv_dtype=kv_dtype,
    )
