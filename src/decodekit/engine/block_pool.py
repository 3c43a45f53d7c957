"""KV cache in blocks with reference counts (PagedAttention, Kwon et al. 2023).

`BlockPool` owns the storage, keys and values `[layers, H_kv, num_blocks, block_size, D]`,
a reference count per block and the free list; with a `PrefixCache` the blocks nobody
uses keep their KV until the pool needs them (prefix_cache.py). A sequence's KV is a
`BlockTable`: the blocks holding its positions 0, 1, ... in order, and how many
positions are stored. `BlockManager` implements the table operations:

- `new_table(tokens)`  a table that starts with the prompt's cached leading blocks (and a
                       finished sequence's cached partial last block: `register_last`);
- `reserve(table, k)`  room for k more positions (new blocks as needed), returning the
                       flat slots to write; a block that is shared or cached is copied
                       before it is written (copy-on-write);
- `fork(table)`        a second table sharing every full block (the partially filled
                       last block is copied, so the two can grow apart);
- `crop(table, n)`     roll back to n positions (rejected speculative tokens);
- `free(table)`        drop the table's references.

The pool may store its KV in another dtype than the model computes in (`kv_dtype`, seed
001's quantised cache): bfloat16, or int8 with one float32 scale per layer, head and
position (symmetric absmax over the head's D values, `quantize_int8`). `write` stores a
step's new keys and values and returns them as `read` will give them back, in the model's
dtype, so the attention of a step and of every later step sees the same stored values.

The pool is zero-initialised, so a gather that reaches past a sequence's end reads
finite values, which the attention mask then gives weight zero. Its storage grows by
doubling up to `num_blocks` as blocks are first used, so a long-lived engine with a
generous bound (engine/engine.py `engine_for`) holds only the memory its KV has needed so far.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from decodekit.engine.prefix_cache import ROOT_KEY, PrefixCache, block_key
from decodekit.models.contiguous_kv import dequantize_int8, quantize_int8


def block_bytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype
) -> int:
    """Bytes of one block's keys and values over all layers (int8: its float32 scales too)."""
    per_vector = head_dim * kv_dtype.itemsize
    if kv_dtype == torch.int8:
        per_vector += 4
    return 2 * num_layers * num_kv_heads * block_size * per_vector


class OutOfBlocks(RuntimeError):
    """The pool has no free or idle block left (the scheduler preempts and retries)."""


class PoolCorrupted(RuntimeError):
    """The pool's reference counts disagree with its tables (`BlockPool.check`)."""


class BlockPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, prefix_cache: PrefixCache | None = None,
                 device: str | torch.device = "cpu", kv_dtype: torch.dtype | None = None):  # fmt: skip
        """dtype: the model's, which `read` and `write` return; kv_dtype: the stored one
        (None: the model's; torch.int8 adds a scale per layer, head and position)."""
        # Heads outermost: a gather of blocks (index_select on dim 2) yields, per head, each
        # sequence's [S, D] keys contiguous, the layout SDPA reads fastest.
        shape = (num_layers, num_kv_heads, min(num_blocks, 64), block_size, head_dim)
        kv_dtype = kv_dtype or dtype
        self.keys = torch.zeros(shape, dtype=kv_dtype, device=device)  # [N, H_kv, capacity, block_size, D]
        self.values = torch.zeros(shape, dtype=kv_dtype, device=device)
        self.dtype = dtype
        # int8: [N, H_kv, capacity, block_size] float32 scales of keys and of values
        self.scales = None
        if kv_dtype == torch.int8:
            self.scales = torch.ones((2, *shape[:-1]), dtype=torch.float32, device=device)
        self.block_size = block_size
        self.refs = [0] * num_blocks
        self.free: deque[int] = deque()  # released blocks, reused first (their memory is warm)
        self.fresh = 0  # blocks 0..fresh-1 have been handed out at least once
        self.cache = prefix_cache
        self.num_used = 0
        # Blocks promised to admitted programs and not yet allocated (engine/program.py):
        # not available to the scheduler's admissions and preemptions.
        self.held = 0
        # While an engine step runs: each table `reserve` grew, with its length before the
        # step, so a failed step can give back what it reserved (`BlockManager.rollback`).
        self.journal: dict[int, tuple[BlockTable, int]] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.refs)

    @property
    def num_free(self) -> int:
        """Blocks nobody uses that hold no cached KV: released ones and never used ones."""
        return len(self.free) + self.num_blocks - self.fresh

    @property
    def num_available(self) -> int:
        """Blocks `allocate` can hand out, free ones and idle cached ones, less those held
        for programs."""
        idle = self.cache.num_idle if self.cache is not None else 0
        return self.num_free + idle - self.held

    @property
    def nbytes(self) -> int:
        """Bytes of the storage allocated so far (it grows by doubling: `_reserve`)."""
        scales = self.scales.nbytes if self.scales is not None else 0
        return self.keys.nbytes + self.values.nbytes + scales

    @property
    def bytes_per_block(self) -> int:
        layers, kv_heads, _, block_size, head_dim = self.keys.shape
        return block_bytes(layers, block_size, kv_heads, head_dim, self.keys.dtype)

    def write(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys and values [H_kv, T, D] of `layer` at flat `slots` [T]; returns them
        as `read` gives them back (the inputs themselves when stored in the model's dtype)."""
        kv_heads, _, dim = k.shape
        out = []
        for side, (store, x) in enumerate(((self.keys, k), (self.values, v))):
            flat = store[layer].view(kv_heads, -1, dim)
            if self.scales is not None:
                codes, scale = quantize_int8(x)  # [H_kv, T, D], [H_kv, T]
                flat.index_copy_(1, slots, codes)
                self.scales[side, layer].view(kv_heads, -1).index_copy_(1, slots, scale)
                out.append(dequantize_int8(codes, scale, self.dtype))
            elif store.dtype != self.dtype:
                stored = x.to(store.dtype)
                flat.index_copy_(1, slots, stored)
                out.append(stored.to(self.dtype))
            else:
                flat.index_copy_(1, slots, x)
                out.append(x)
        return out[0], out[1]

    def write_layers(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys and values [N, H_kv, T, D] of every layer at flat `slots` [T] in one
        write each (a pool that stores the model's dtype: engine/compiled.py)."""
        if self.scales is not None or self.keys.dtype != self.dtype:
            raise TypeError(f"write_layers stores {self.dtype} as it is, not into a {self.keys.dtype} pool")
        num_layers, kv_heads, _, dim = k.shape
        self.keys.view(num_layers, kv_heads, -1, dim).index_copy_(2, slots, k)
        self.values.view(num_layers, kv_heads, -1, dim).index_copy_(2, slots, v)

    def read(self, blocks: torch.Tensor, layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `blocks` [nb] in order, in the model's dtype: [H_kv, nb * block_size,
        D] of `layer`, or [N, H_kv, nb * block_size, D] of every layer when None."""
        out = []
        for side, store in enumerate((self.keys, self.values)):
            scales = self.scales[side] if self.scales is not None else None
            if layer is not None:
                store = store[layer]
                scales = scales[layer] if scales is not None else None
            axis = store.dim() - 3  # the block axis
            flat = store.index_select(axis, blocks).flatten(axis, axis + 1)
            if scales is not None:
                scale = scales.index_select(axis, blocks).flatten(axis, axis + 1)
                flat = dequantize_int8(flat, scale, self.dtype)
            elif flat.dtype != self.dtype:
                flat = flat.to(self.dtype)
            out.append(flat)
        return out[0], out[1]

    def allocate(self) -> int:
        if self.free:
            block = self.free.popleft()
        elif self.fresh < self.num_blocks:
            block, self.fresh = self.fresh, self.fresh + 1
            self._reserve(self.fresh)
        elif self.cache is not None and self.cache.num_idle:
            block = self.cache.evict()  # idle only: never a block in use
        else:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        if self.refs[block]:  # a block in use handed out again: two sequences would share KV
            raise PoolCorrupted(f"block {block} is handed out with {self.refs[block]} references")
        self.refs[block] = 1
        self.num_used += 1
        return block

    def _reserve(self, blocks: int) -> None:
        """Storage for at least `blocks` blocks, doubling (zero-filled) up to `num_blocks`."""
        capacity = self.keys.shape[2]
        if blocks <= capacity:
            return
        capacity = min(max(blocks, 2 * capacity), self.num_blocks)
        self.keys, self.values = (_grown(old, 2, capacity) for old in (self.keys, self.values))
        if self.scales is not None:
            self.scales = _grown(self.scales, 3, capacity)

    def share(self, block: int) -> None:
        if self.refs[block] == 0:
            if self.cache is None:  # only the prefix cache hands out a block nobody holds
                raise PoolCorrupted(f"block {block} is shared with no reference and no prefix cache")
            self.cache.unpark(block)
            self.num_used += 1
        self.refs[block] += 1

    def release(self, block: int) -> None:
        if self.refs[block] <= 0:  # released twice: its KV could be handed out while in use
            raise PoolCorrupted(f"block {block} is released with {self.refs[block]} references")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.num_used -= 1
            if self.cache is not None and self.cache.is_cached(block):
                self.cache.park(block)
            else:
                self.free.append(block)

    def check(self, tables: Sequence[BlockTable]) -> None:
        """Raise `PoolCorrupted` unless the pool's books agree with the live `tables` (every
        table that holds blocks of this pool): each block's reference count is the number of
        tables that hold it, and a block nobody holds is exactly one of free, idle cached or
        never handed out. A check that raises, not an `assert`: it guards the KV that later
        requests read (python -O keeps it)."""
        counts = [0] * self.num_blocks
        for table in tables:
            for block in table.blocks:
                counts[block] += 1
        problems = []
        wrong = [b for b in range(self.num_blocks) if counts[b] != self.refs[b]]
        if wrong:
            b = wrong[0]
            problems.append(f"{len(wrong)} blocks have wrong reference counts (block {b}: "
                            f"{self.refs[b]} counted, {counts[b]} tables hold it)")  # fmt: skip
        if self.num_used != sum(1 for r in self.refs if r):
            problems.append(f"num_used {self.num_used} but {sum(1 for r in self.refs if r)} blocks in use")
        free, idle = set(self.free), self.cache.idle_blocks() if self.cache is not None else set()
        if len(free) != len(self.free):
            problems.append("a block is on the free list twice")
        lost = [b for b in range(self.fresh)
                if (b in free) + (b in idle) != (1 if self.refs[b] == 0 else 0)]  # fmt: skip
        if lost:
            problems.append(f"{len(lost)} blocks are neither exactly in use, free or idle (block {lost[0]})")
        if self.held < 0:
            problems.append(f"held is {self.held}")
        if problems:
            raise PoolCorrupted("KV block pool: " + "; ".join(problems))

    def copy(self, source: int, target: int) -> None:
        with torch.inference_mode():
            self.keys[:, :, target] = self.keys[:, :, source]
            self.values[:, :, target] = self.values[:, :, source]
            if self.scales is not None:
                self.scales[:, :, :, target] = self.scales[:, :, :, source]


def _grown(old: torch.Tensor, axis: int, capacity: int) -> torch.Tensor:
    """`old` zero-padded to `capacity` along its block axis."""
    new = old.new_zeros((*old.shape[:axis], capacity, *old.shape[axis + 1 :]))
    new.narrow(axis, 0, old.shape[axis]).copy_(old)
    return new


@dataclass
class BlockTable:
    """One sequence's blocks. `keys[i]` is the prefix-cache key of full block i, for the
    leading full blocks registered so far."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0  # positions whose K/V are stored (or reserved for this step)
    keys: list[int] = field(default_factory=list)


class BlockManager:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size

    def blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def new_table(self, tokens: Sequence[int]) -> BlockTable:
        """A table holding the longest cached run of the prompt's leading full blocks.

        At most len(tokens) - 1 positions are reused: the last prompt token is always
        computed, since its logits choose the first new token.
        """
        table = BlockTable()
        cache = self.pool.cache
        if cache is None:
            return table
        size = self.block_size
        parent = ROOT_KEY
        for start in range(0, len(tokens) - 1 - size + 1, size):
            chunk = tokens[start : start + size]
            key = block_key(parent, chunk)
            block = cache.lookup(key, chunk)
            if block is None:
                break
            self.pool.share(block)
            table.blocks.append(block)
            table.keys.append(key)
            parent = key
        table.length = len(table.blocks) * size
        rest = tokens[table.length : len(tokens) - 1]
        for count in range(min(len(rest), size - 1), 0, -1):  # a finished sequence's last block
            block = cache.lookup(block_key(parent, rest[:count]), rest[:count])
            if block is not None:
                self.pool.share(block)  # read-only: `reserve` copies it before writing
                table.blocks.append(block)
                table.length += count
                break
        return table

    def blocks_needed(self, table: BlockTable, count: int) -> int:
        """Blocks `reserve(table, count)` may allocate (a copy-on-write included)."""
        new = self.blocks_for(table.length + count) - len(table.blocks)
        return new + (1 if table.length % self.block_size else 0)

    def reserve(self, table: BlockTable, count: int) -> list[int]:
        """Room for `count` more positions; returns their flat slots (block * size + offset)."""
        size = self.block_size
        if self.pool.journal is not None:
            self.pool.journal.setdefault(id(table), (table, table.length))
        if table.length % size:
            last = table.blocks[-1]
            cache = self.pool.cache
            if self.pool.refs[last] > 1 or (cache is not None and cache.is_cached(last)):
                copy = self.pool.allocate()  # copy-on-write: the shared block stays as it is
                self.pool.copy(last, copy)
                self.pool.release(last)
                table.blocks[-1] = copy
        while len(table.blocks) < self.blocks_for(table.length + count):
            table.blocks.append(self.pool.allocate())
        positions = range(table.length, table.length + count)
        table.length += count
        return [table.blocks[p // size] * size + p % size for p in positions]

    def register(self, table: BlockTable, tokens: Sequence[int], computed: int) -> None:
        """Make the full blocks among the first `computed` positions findable by later prompts."""
        cache = self.pool.cache
        if cache is None:
            return
        size = self.block_size
        for index in range(len(table.keys), computed // size):
            chunk = tokens[index * size : (index + 1) * size]
            key = block_key(table.keys[-1] if table.keys else ROOT_KEY, chunk)
            cache.register(table.blocks[index], key, chunk)
            table.keys.append(key)

    def register_last(self, table: BlockTable, tokens: Sequence[int]) -> None:
        """A finished sequence's partially filled last block becomes findable too (keyed like
        a full block, by its fewer tokens), so a prompt that extends the sequence's text (a
        tree-search child, a refinement round) reuses all of its KV, not only its full blocks.
        Call with every full block registered and every position computed."""
        cache = self.pool.cache
        size = self.block_size
        count = table.length % size
        if cache is None or not count or len(table.keys) != table.length // size:
            return
        block = table.blocks[-1]
        if self.pool.refs[block] == 1 and not cache.is_cached(block):
            chunk = tokens[table.length - count : table.length]
            cache.register(block, block_key(table.keys[-1] if table.keys else ROOT_KEY, chunk), chunk)

    def rollback(self) -> None:
        """Crop every table the journal saw grow back to its length before the step: the
        positions a failed step reserved were never (or only partly) written, and must not be
        registered in the prefix cache nor read by anyone (SGLang and vLLM free a failed
        step's slots the same way). A table since freed or cropped below that length is left."""
        journal, self.pool.journal = self.pool.journal or {}, {}
        for table, length in journal.values():
            if table.length > length:
                self.crop(table, length)

    def fork(self, table: BlockTable) -> BlockTable:
        size = self.block_size
        full = table.length // size
        for block in table.blocks[:full]:
            self.pool.share(block)
        other = BlockTable(list(table.blocks[:full]), table.length, list(table.keys))
        if table.length % size:
            copy = self.pool.allocate()
            self.pool.copy(table.blocks[full], copy)
            other.blocks.append(copy)
        return other

    def crop(self, table: BlockTable, length: int) -> None:
        if not 0 <= length <= table.length:
            raise ValueError(f"crop length must be in [0, {table.length}], got {length}")
        keep = self.blocks_for(length)
        for block in table.blocks[keep:]:
            self.pool.release(block)
        del table.blocks[keep:]
        del table.keys[length // self.block_size :]
        table.length = length

    def free(self, table: BlockTable) -> None:
        for block in table.blocks:
            self.pool.release(block)
        table.blocks.clear()
        table.keys.clear()
        table.length = 0
