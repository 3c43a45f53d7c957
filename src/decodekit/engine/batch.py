"""One engine step's forward: every scheduled token in one flat row, attention over blocks.

The sequences of a step (one new token for each decoding sequence, a whole prompt for
each prefilling one) are concatenated into a single row `[1, T]` with no padding, so
every linear layer runs once over all T tokens (nano-vllm's layout). `PagedBatch` is what
NativeLM's layers receive as their cache: its `attend` writes the new keys and values
into the block pool and computes each sequence's attention over its own blocks:

- decoding sequences together: their blocks are gathered into `[B, H_kv, S, D]` (S the
  longest, a mask hides the rest) and one SDPA call serves them all;
- each prefilling sequence alone: causal attention of its T_i queries over its cached
  prefix and itself.

The layers themselves are NativeLM's (models/native.py): one implementation of the maths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decodekit.engine.kv import BlockPool, BlockTable
from decodekit.models.kv import attend as dense_attend
from decodekit.models.kv import causal_mask
from decodekit.models.native import NativeLM


@dataclass
class PrefillSpan:
    start: int  # first position of the sequence's tokens in the flat row
    end: int
    blocks: torch.Tensor  # [nb] its block table
    length: int  # positions stored after this step (cached prefix + new tokens)


@dataclass
class DecodeGroup:
    rows: torch.Tensor | None  # [B] positions in the flat row, None when it is the whole row
    blocks: torch.Tensor  # [B, nb] block tables, padded with block 0
    mask: torch.Tensor | None  # [B, 1, 1, nb * block_size] keys each row may see
    width: int  # nb * block_size


class PagedBatch:
    """The attention backend of one step (see the module docstring)."""

    def __init__(
        self,
        pool: BlockPool,
        slots: torch.Tensor,  # [T] flat slot of every new token
        decode: DecodeGroup | None,
        prefills: list[PrefillSpan],
    ):
        self.pool = pool
        self.slots = slots
        self.decode = decode
        self.prefills = prefills

    def attend(self, layer, q, k, v, mask, causal) -> torch.Tensor:
        """q [1, T, H, D], k/v [1, T, H_kv, D] -> [1, T, H, D]; mask/causal are unused."""
        pool = self.pool
        _, total, heads, dim = q.shape
        kv_heads = k.shape[2]
        keys = pool.keys[layer]  # [blocks, block_size, H_kv, D]
        values = pool.values[layer]
        keys.view(-1, kv_heads, dim).index_copy_(0, self.slots, k[0])
        values.view(-1, kv_heads, dim).index_copy_(0, self.slots, v[0])
        if self.decode is not None and not self.prefills and self.decode.rows is None:
            return self._decode(q[0], keys, values)[None]  # every token decodes: no scatter
        out = torch.empty_like(q[0])  # [T, H, D]
        if self.decode is not None:
            out[self.decode.rows] = self._decode(q[0, self.decode.rows], keys, values)
        for span in self.prefills:
            out[span.start : span.end] = _prefill(q[0, span.start : span.end], keys, values, span)
        return out[None]

    def _decode(self, q: torch.Tensor, keys, values) -> torch.Tensor:
        """q [B, H, D] (one token per sequence) -> [B, H, D]."""
        group = self.decode
        batch, heads, dim = q.shape
        kv_heads = keys.shape[2]
        # [B, nb, block_size, H_kv, D] -> [B, H_kv, S, D]
        k = keys[group.blocks].view(batch, group.width, kv_heads, dim).transpose(1, 2)
        v = values[group.blocks].view(batch, group.width, kv_heads, dim).transpose(1, 2)
        # Fold the query heads that share a key head into the query axis (as models/kv.py).
        folded = q.view(batch, kv_heads, heads // kv_heads, dim)  # [B, H_kv, G, D]
        out = F.scaled_dot_product_attention(folded, k, v, attn_mask=group.mask)
        return out.reshape(batch, heads, dim)


def _prefill(q: torch.Tensor, keys, values, span: PrefillSpan) -> torch.Tensor:
    """q [T_i, H, D] of one sequence -> [T_i, H, D], causal over its blocks."""
    num_new, heads, dim = q.shape
    kv_heads = keys.shape[2]
    k = keys[span.blocks].view(-1, kv_heads, dim)[: span.length].transpose(0, 1)[None]
    v = values[span.blocks].view(-1, kv_heads, dim)[: span.length].transpose(0, 1)[None]
    start = span.length - num_new
    mask = None if start == 0 else causal_mask(start, num_new)[None, None]  # [1, 1, T, S]
    out = dense_attend(q.transpose(0, 1)[None], k, v, mask, causal=start == 0)  # [1, H, T, D]
    return out[0].transpose(0, 1)


@torch.inference_mode()
def paged_forward(
    model: NativeLM,
    tokens: torch.Tensor,  # [T] every scheduled token
    positions: torch.Tensor,  # [T] their positions in their sequences
    batch: PagedBatch,
    keep: torch.Tensor,  # [K] flat indices whose logits are wanted
) -> torch.Tensor:
    """Logits [K, V] float32 of the kept positions."""
    cos, sin = model.rope.tables(int(positions.max()) + 1)
    cos, sin = cos[positions][None, :, None], sin[positions][None, :, None]  # [1, T, 1, D]
    return model.net(tokens[None], cos, sin, batch, None, False, keep)[0]


def build_batch(pool: BlockPool, items: list[tuple[BlockTable, list[int], list[int]]]):
    """tokens [T], positions [T], the PagedBatch and kept indices [K] of a step.

    items: per sequence, its table (already holding `len(slots)` reserved positions), its
    tokens (at least `table.length` of them) and the slots of its new positions. Each
    sequence's last new token's logits are kept, in the order of `items`.
    """
    tokens: list[int] = []
    positions: list[int] = []
    all_slots: list[int] = []
    keep: list[int] = []
    decode_at: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lengths: list[int] = []
    prefills: list[PrefillSpan] = []
    for table, seq_tokens, slots in items:
        count, length = len(slots), table.length
        start = len(tokens)
        tokens += seq_tokens[length - count : length]
        positions += range(length - count, length)
        all_slots += slots
        keep.append(start + count - 1)
        if count == 1:
            decode_at.append(start)
            decode_tables.append(table.blocks)
            decode_lengths.append(length)
        else:
            blocks = torch.tensor(table.blocks, dtype=torch.long)
            prefills.append(PrefillSpan(start, start + count, blocks, length))
    decode = None
    if decode_at:
        decode = _decode_group(decode_at, decode_tables, decode_lengths, pool.block_size)
        if decode_at == list(range(len(tokens))):
            decode.rows = None
    batch = PagedBatch(pool, torch.tensor(all_slots, dtype=torch.long), decode, prefills)
    as_long = torch.tensor
    return as_long(tokens), as_long(positions), batch, as_long(keep)


def _decode_group(at, tables, lengths, block_size) -> DecodeGroup:
    width = max(len(t) for t in tables)
    blocks = torch.zeros((len(tables), width), dtype=torch.long)  # [B, nb], padded with 0
    for row, table in enumerate(tables):
        blocks[row, : len(table)] = torch.tensor(table, dtype=torch.long)
    span = width * block_size
    mask = None
    if any(length != span for length in lengths):
        visible = torch.arange(span)[None, :] < torch.tensor(lengths)[:, None]  # [B, S]
        mask = visible[:, None, None, :]  # [B, 1, 1, S]
    return DecodeGroup(torch.tensor(at, dtype=torch.long), blocks, mask, span)
