"""`RunningKV`: the running sequences' keys and values, one dense row each, for decoding.

Decode attention reads every cached key of every running sequence at every step. Read
from the block pool, each step would first gather the blocks into one tensor: measured on
the dev machine (64 sequences of ~200 positions, one layer) a gather plus SDPA costs
2.4-5 ms where SDPA over dense rows costs 1.0 ms (BENCHMARKS.md, "Fast engine"). So a
sequence's KV is gathered from its blocks once, when it starts decoding (or copied from
its parent's row when it is forked), and each step appends one position to it; the block
pool stays the record that fork, crop, the prefix cache and preemption work on, and
receives every new position too.

Rows are kept compact: the running sequences occupy rows 0..B-1, and a leaving sequence's
row is filled with the last one, so a decode step attends over the view `[:B, :, :S]`
with no gather and no index. Both dimensions grow by doubling.

The n samples of one prompt share it (`add_shared`): the prompt's KV is kept once as a
`SharedPrefix` and each sample's row holds only the positions after it. Attention then
reads the prefix once per step for all n samples and merges it with each row's own part
by their log-sum-exps (cascade / bifurcated attention: Hydragen, Juravsky et al. 2024;
FlashInfer's cascade inference), instead of reading n copies of the prompt (batch.py), on a
GPU too (its graphed step: cuda_graphs.py) where it pays (`shares`): a GPU's rows then hold
only the samples' own tokens, not n copies of the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decodekit.engine.block_pool import BlockPool

# On a GPU a step over shared prefixes costs ~16 more kernels a layer than one over whole rows
# (its attention over [prefix, row] written out instead of one SDPA kernel: 33-35 ATen calls a
# layer of qwen2.5-0.5b against 19, benchmarks/graph_step_ops.py), ~40 us a layer at ~2.5 us
# a replayed kernel, the time an H200 takes to read ~150 MB. Sharing pays there when the
# copies of the prompt it saves would read more than this each step, a layer (16 samples of
# a 512-token prompt at qwen2.5-0.5b's 512 bytes a position and layer: 4 MB, so not shared;
# 64 samples of 8,000 tokens at Llama-3-8B's 4 KiB: 2 GB). An estimate from kernel counts and
# bandwidth, not yet timed on a GPU (scripts/gpu_check.sh). The CPU always shares (its eager
# merge is one more kernel; measured: BENCHMARKS.md).
GPU_SHARE_MIN_BYTES = 128 * 2**20


@dataclass(eq=False)
class SharedPrefix:
    """The KV of a prompt shared by the rows of its samples."""

    keys: torch.Tensor  # [N, 1, H_kv, P, D]
    values: torch.Tensor

    @property
    def length(self) -> int:
        return self.keys.shape[3]


class RunningKV:
    """share_prefixes=False: every row holds its whole sequence (the batch-invariant mode,
    where a row's attention must not depend on its request's other samples, and
    sliding-window models, whose windows would have to mask the shared part too)."""

    def __init__(
        self, pool: BlockPool, rows: int = 8, capacity: int = 64, share_prefixes: bool = True
    ):
        num_layers, kv_heads, _, _, head_dim = pool.keys.shape
        shape = (num_layers, rows, kv_heads, capacity, head_dim)
        # In the model's dtype whatever the pool stores (block_pool.py): a working copy of the running
        # sequences, read whole at every step.
        self.keys = pool.keys.new_zeros(shape, dtype=pool.dtype)  # [N, R, H_kv, C, D]
        self.values = pool.keys.new_zeros(shape, dtype=pool.dtype)
        self.pool = pool
        self.owners: list[object] = []  # the sequence in each used row
        self.lengths: list[int] = []  # positions stored in each used row (after its prefix)
        self.prefixes: list[SharedPrefix | None] = []  # the shared prefix each row continues
        # On every device: the CPU's eager step merges the prefix's attention by its log-sum-exp
        # kernel, a GPU's (and a compiled step) by one softmax written out (models/attention.py).
        self.share_prefixes = share_prefixes

    def __len__(self) -> int:
        return len(self.owners)

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def add(self, owner, blocks: list[int], length: int) -> int:
        """A row for `owner` holding positions [0, length) read from its blocks."""
        row = self._new_row(owner, length)
        keys, values = self._gather(blocks, length)
        self.keys[:, row, :, :length] = keys
        self.values[:, row, :, :length] = values
        return row

    def add_shared(self, owners: list, blocks: list[int], length: int) -> list[int]:
        """Rows for samples that all continue positions [0, length) of these blocks: the
        prefix is read once and shared, and each row starts empty."""
        if not self.shares(len(owners), length):
            first = self.add(owners[0], blocks, length)
            return [first] + [self.copy(owner, first) for owner in owners[1:]]
        keys, values = self._gather(blocks, length)  # [N, H_kv, P, D]
        prefix = SharedPrefix(keys[:, None].clone(), values[:, None].clone())
        return [self._new_row(owner, 0, prefix) for owner in owners]

    def shares(self, samples: int, length: int) -> bool:
        """Whether `samples` rows that continue `length` positions share them (module
        docstring): always on the CPU; on a GPU when the copies it saves would read at
        least GPU_SHARE_MIN_BYTES a layer each step."""
        if not self.share_prefixes:
            return False
        if self.keys.is_cpu:
            return True
        _, _, kv_heads, _, head_dim = self.keys.shape
        copies = 2 * (samples - 1) * length * kv_heads * head_dim * self.keys.element_size()  # keys, values
        return copies >= GPU_SHARE_MIN_BYTES

    def total_length(self, row: int) -> int:
        """Positions a row's sequence attends to: its shared prefix and its own."""
        prefix = self.prefixes[row]
        return self.lengths[row] + (prefix.length if prefix is not None else 0)

    def _gather(self, blocks: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [0, length) of a block table, [N, H_kv, length, D] keys and values."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.pool.keys.device)
        keys, values = self.pool.read(index)  # [N, H_kv, nb * block_size, D]
        return keys[:, :, :length], values[:, :, :length]

    def copy(self, owner, source: int) -> int:
        """A row for `owner` holding a copy of row `source` (a forked sample)."""
        length = self.lengths[source]
        row = self._new_row(owner, length, self.prefixes[source])
        self.keys[:, row, :, :length] = self.keys[:, source, :, :length]
        self.values[:, row, :, :length] = self.values[:, source, :, :length]
        return row

    def remove(self, row: int) -> object | None:
        """Free `row`; the last row moves into it. Returns the moved owner (or None)."""
        last = len(self.owners) - 1
        moved = None
        if row != last:
            length = self.lengths[last]
            self.keys[:, row, :, :length] = self.keys[:, last, :, :length]
            self.values[:, row, :, :length] = self.values[:, last, :, :length]
            moved = self.owners[row] = self.owners[last]
            self.lengths[row] = length
            self.prefixes[row] = self.prefixes[last]
        self.owners.pop()
        self.lengths.pop()
        self.prefixes.pop()
        return moved

    def leave(self, owner) -> None:
        """`owner` (a sequence with a `lane`) gives up its row; the row's new owner, the last
        row's, gets the lane number."""
        moved = self.remove(owner.lane)
        if moved is not None:
            moved.lane = owner.lane
        owner.lane = None

    def grow(self, extra: int = 1) -> None:
        """Every row gains `extra` positions (this step's tokens); makes room for them."""
        self.lengths = [n + extra for n in self.lengths]
        self._reserve(len(self.owners), max(self.lengths, default=0))

    def reserve_rows(self, rows: int) -> None:
        """Storage for at least `rows` rows (a compiled step's padded bucket reads them)."""
        self._reserve(rows, max(self.lengths, default=0))

    def _new_row(self, owner, length: int, prefix: SharedPrefix | None = None) -> int:
        self._reserve(len(self.owners) + 1, length)
        self.owners.append(owner)
        self.lengths.append(length)
        self.prefixes.append(prefix)
        return len(self.owners) - 1

    def _reserve(self, rows: int, length: int) -> None:
        _, have_rows, _, have_length, _ = self.keys.shape
        if rows <= have_rows and length <= have_length:
            return
        rows, length = max(rows, have_rows), max(length, have_length)
        rows = rows if rows == have_rows else max(rows, 2 * have_rows)
        length = length if length == have_length else max(length, 2 * have_length)
        used, stored = len(self.owners), min(max(self.lengths, default=0), have_length)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((old.shape[0], rows, old.shape[2], length, old.shape[4]))
            new[:, :used, :, :stored] = old[:, :used, :, :stored]
            setattr(self, name, new)


class GatheredRows:
    """One step's dense rows gathered from the pool, for sequences without a RunningKV lane
    whose sequences crop and catch up every block, so a lane would be given up as often as
    taken: a member model's that each feed one token (a speculative draft, a contrastive
    amateur: rounds.py `member_forward`), or a verification's that each feed T tokens
    (compile_policy.py `CompiledSpans`). What the compiled step (`CompiledDecode`) reads of a
    RunningKV: `keys`, `values` [N, R, H_kv, C, D] (R >= 2: a graph compiled for R rows is
    not specialised to one), `lengths` (each row's positions, its new ones included),
    `prefixes` (none shared), `reserve_rows`. Gathered on first use, so a step that stays
    eager gathers nothing."""

    def __init__(self, pool: BlockPool, blocks: list[list[int]], lengths: list[int]):
        self.pool = pool
        self.blocks = blocks  # each row's block table, its new position's block included
        self.lengths = lengths
        self.prefixes: list[SharedPrefix | None] = [None] * len(lengths)
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self._filled = 0  # rows gathered or zeroed

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def keys(self) -> torch.Tensor:
        return self._gathered(len(self))[0]

    @property
    def values(self) -> torch.Tensor:
        return self._gathered(len(self))[1]

    def reserve_rows(self, rows: int) -> None:
        """At least `rows` rows (a compiled bucket's padding: rows that see nothing)."""
        self._gathered(rows)

    def _gathered(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = max(rows, len(self))  # the rows a compiled bucket reads: the sequences' and padding
        if self._rows is not None and self._filled >= rows:
            return self._rows
        width = max(len(blocks) for blocks in self.blocks)
        # Short tables padded with their first block: every gathered key is a finite number,
        # which the attention's mask weighs by zero (a stale NaN would not stay zero).
        index = torch.tensor([blocks + blocks[:1] * (width - len(blocks)) for blocks in self.blocks],
                             dtype=torch.long, device=self.pool.keys.device)  # fmt: skip
        out = []
        for store in (self.pool.keys, self.pool.values):  # [N, H_kv, capacity, block_size, D]
            layers, kv_heads, _, block_size, dim = store.shape
            dense = store.new_empty((layers, max(rows, 2), kv_heads, width * block_size, dim))
            for row in range(len(self)):  # each row's blocks copied once, straight into its place
                place = dense[:, row].view(layers, kv_heads, width, block_size, dim)
                torch.index_select(store, 2, index[row], out=place)
            dense[:, len(self) : rows] = 0  # a bucket's padding rows: each sees only its own new key
            out.append(dense)  # a row past `rows` (R >= 2) is never read: left as it is
        self._rows, self._filled = (out[0], out[1]), rows
        return self._rows
