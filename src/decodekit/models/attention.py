"""Attention: every query decodekit's own forward computes attends in one of three functions.

- `decode_attention`: each row's T >= 1 new queries over its row's stored keys, over a shared
  prefix for the rows that continue one (cascade attention), and over their own T new keys
  passed beside the stored ones (`new`), causally among themselves. T = 1: the eager engine
  step (engine/batch.py), the compiled engine step (engine/compiled.py `LaneAttention`), the
  static step (models/static.py) and a contiguous cache's one-token step; T > 1: the compiled
  verification step (`lanes_step(span=T)`), whose eager twin is `prefill_attention` under a mask.
- `prefill_attention`: T queries per row, causal or under a mask (prompts, verification
  spans, the contiguous caches); one query per row is `decode_attention`.
- `attend_alone`: one query over exactly the keys it sees (the batch-invariant mode).

`softcap` (Gemma 2's attn_logit_softcapping): every score s becomes cap * tanh(s / cap) before
the softmax. The fused kernels cannot do that, so each function then takes its written-out form.

Grouped-query attention folds the G query heads that share a key head, and a row's T
queries, into the query axis, [B, T, H, D] -> [B, H_kv, G * T, D] (row g * T + t), so each
key is read once, not once per query head and query.

`decode_attention` has two formulations of the same maths. Eager, one fused kernel: SDPA,
and where rows continue a shared prefix, the log-sum-exp-returning flash kernel over the
prefix (its keys read once for every row that continues it) merged with each row's own part
by the two log-sum-exps (Hydragen, Juravsky et al. 2024; FlashInfer's cascade inference).
Traced by torch.compile (or where that kernel is missing: off the CPU), written out: scores,
one softmax over [prefix, row, new keys], two matmuls, which inductor fuses into a few kernels
where CPU flash attention over a whole static buffer costs ~100 us a layer whatever the
length (models/static.py). The two agree to rounding (tests/models/test_attention.py). T > 1
new keys are always written out (the eager kernels would need a [G * T, S + T] mask); T = 1
builds no causal mask and scores its one new key by a dot product, not a matmul.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

# SDPA that also returns the log-sum-exp, which merging a shared prefix's attention with a
# row's own needs (a private ATen op of the CPU build; without it the written-out form runs).
LSE_KERNEL = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


class SharedKV(NamedTuple):
    """One layer of a prefix some rows continue: its keys are read once for all of them."""

    keys: torch.Tensor  # [1, H_kv, P, D]
    values: torch.Tensor  # [1, H_kv, P, D]
    rows: torch.Tensor | None = None  # [n] the rows that continue it; None: every row, as `sees` says
    sees: torch.Tensor | None = None  # [B, 1, 1, P] bool, the prefix positions each row sees; None: all


def capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Scores capped to (-softcap, softcap) by cap * tanh(s / cap) (module docstring)."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def decode_attention(
    q: torch.Tensor,  # [B, T, H, D], each row's T new queries, rotated
    keys: torch.Tensor,  # [B, H_kv, S, D], each row's stored keys
    values: torch.Tensor,  # [B, H_kv, S, D]
    visible: torch.Tensor | None,  # [B or 1, 1, 1, S]: bool, or SDPA's additive float; None: all S
    new: tuple[torch.Tensor, torch.Tensor] | None = None,  # k, v [B, T, H_kv, D] not in `keys`
    prefixes: tuple[SharedKV, ...] | list[SharedKV] = (),
    written_out: bool | None = None,  # the formulation (module docstring); None: chosen here
    softcap: float | None = None,  # the scores' cap (module docstring): written out
) -> torch.Tensor:
    """Each row's queries over [its prefix's keys, `keys`, its `new` keys]: [B, T, H, D].

    All T queries of a row see the same prefix and stored keys; query t sees new keys 0..t.
    `new`: the row's own keys beside `keys` (the compiled step's graph writes nothing; the
    others store the new key first).
    """
    batch, count, heads, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    queries = group * count  # a row's queries of one key head
    # [B, H_kv, G * T, D]; at T = 1 the transpose would only add a view
    folded = (q if count == 1 else q.transpose(1, 2)).reshape(batch, kv_heads, queries, dim)
    # written out when traced, for T > 1 new keys (no causal mask in the eager form), and for
    # prefixes the LSE kernel cannot take: it is the CPU's, and a row seeing none of one gets lse 0
    if written_out is None or softcap is not None:
        written_out = (
            softcap is not None
            or torch.compiler.is_compiling()
            or (new is not None and count > 1)
            or (
                bool(prefixes)
                and (LSE_KERNEL is None or not q.is_cpu or any(p.sees is not None for p in prefixes))
            )
        )
    assert written_out or new is None or count == 1, "T > 1 new keys are written out"
    if written_out:
        scale = dim**-0.5
        parts = []  # scores [B, H_kv, G * T, n] over each key set in turn, masked
        for prefix in prefixes:  # the prefix's keys read once for all B * G * T queries of a key head
            stacked = folded.transpose(0, 1).reshape(kv_heads, batch * queries, dim)  # [H_kv, BGT, D]
            shared = (stacked @ prefix.keys[0].transpose(-1, -2)).float() * scale  # [H_kv, BGT, P]
            shared = capped(shared, softcap)
            shared = shared.reshape(kv_heads, batch, queries, -1).transpose(0, 1)  # [B, H_kv, GT, P]
            sees = prefix.sees
            if prefix.rows is not None:  # the rows that continue it see all of it, the others none
                sees = torch.zeros(batch, dtype=torch.bool, device=q.device).index_fill_(0, prefix.rows, True)
                sees = sees[:, None, None, None]  # [B, 1, 1, 1]
            parts.append(shared if sees is None else shared.masked_fill(~sees, -torch.inf))
        stored = capped((folded @ keys.transpose(-1, -2)).float() * scale, softcap)  # [B, H_kv, GT, S]
        if visible is not None:
            stored = (stored.masked_fill(~visible, -torch.inf) if visible.dtype == torch.bool
                      else stored + visible)  # fmt: skip
        parts.append(stored)
        if new is not None:
            own_keys, own_values = new[0].transpose(1, 2), new[1].transpose(1, 2)  # [B, H_kv, T, D]
            if count == 1:  # one new key each query sees: a dot product, no mask
                own = (folded * own_keys).sum(-1, keepdim=True).float() * scale  # [B, H_kv, G, 1]
                parts.append(capped(own, softcap))
            else:  # query t sees new keys 0..t
                own = (folded @ own_keys.transpose(-1, -2)).float() * scale  # [B, H_kv, GT, T]
                own = capped(own, softcap)
                causal = torch.ones(count, count, dtype=torch.bool, device=q.device).tril()  # [T, T]
                parts.append(own.masked_fill(~causal.repeat(group, 1), -torch.inf))  # [GT, T] mask
        weights = torch.cat(parts, dim=-1).softmax(dim=-1).to(q.dtype)  # one softmax over them all
        start = sum(part.shape[-1] for part in parts[: len(prefixes)])
        out = weights[..., start : start + keys.shape[2]] @ values  # [B, H_kv, GT, D]
        start = 0
        for prefix in prefixes:
            length = prefix.keys.shape[2]
            share = weights[..., start : start + length].transpose(0, 1)  # [H_kv, B, GT, P]
            share = share.reshape(kv_heads, batch * queries, length) @ prefix.values[0]  # [H_kv, BGT, D]
            out = out + share.reshape(kv_heads, batch, queries, dim).transpose(0, 1)
            start += length
        if new is not None:
            own_weights = weights[..., -count:]  # [B, H_kv, GT, T]
            out = out + (own_weights * own_values if count == 1 else own_weights @ own_values)
        return _unfold_heads(out, count)  # [B, T, H, D]
    if new is not None:  # the eager kernels read one key tensor: append the new key to it
        keys = torch.cat([keys, new[0].transpose(1, 2)], dim=2)
        values = torch.cat([values, new[1].transpose(1, 2)], dim=2)
        if visible is not None:
            seen = visible.new_ones(1) if visible.dtype == torch.bool else visible.new_zeros(1)
            visible = torch.cat([visible, seen.expand(*visible.shape[:3], 1)], dim=-1)
    if not prefixes:
        return _unfold_heads(F.scaled_dot_product_attention(folded, keys, values, visible), count)
    if visible is not None and visible.dtype == torch.bool:  # the LSE kernel takes an additive mask
        visible = keys.new_zeros(visible.shape).masked_fill(~visible, -torch.inf)
    out, lse = LSE_KERNEL(folded, keys, values, 0.0, False, attn_mask=visible)  # [B, H_kv, GT, D], [.., GT]
    for prefix in prefixes:  # its rows' queries in one call: the prefix's keys are read once
        rows = prefix.rows if prefix.rows is not None else torch.arange(batch, device=q.device)
        n = len(rows)
        stacked = folded[rows].transpose(0, 1).reshape(1, kv_heads, n * queries, dim)  # [1, H_kv, nGT, D]
        shared, shared_lse = LSE_KERNEL(stacked, prefix.keys, prefix.values, 0.0, False)  # and [.., nGT]
        shared = shared.view(kv_heads, n, queries, dim).transpose(0, 1)  # [n, H_kv, GT, D]
        shared_lse = shared_lse.view(kv_heads, n, queries).transpose(0, 1)  # [n, H_kv, GT]
        # softmax over the union = each part's softmax weighted by its share of the total mass
        own_lse = lse[rows]
        top = torch.maximum(own_lse, shared_lse)
        own_weight = (own_lse - top).exp()[..., None]
        shared_weight = (shared_lse - top).exp()[..., None]
        out[rows] = (out[rows] * own_weight + shared * shared_weight) / (own_weight + shared_weight)
    return _unfold_heads(out, count)


def _unfold_heads(out: torch.Tensor, count: int) -> torch.Tensor:
    """[B, H_kv, G * T, D] -> [B, T, H, D]. T = 1 is a plain reshape: a transpose would give
    the size-1 axis another stride, and inductor one more view of each layer's buffer."""
    batch, _, _, dim = out.shape
    if count == 1:
        return out.reshape(batch, 1, -1, dim)
    return out.reshape(batch, -1, count, dim).transpose(1, 2)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
    softcap: float | None = None,
) -> torch.Tensor:
    """Grouped-query attention. q [B, H, T, D], k/v [B, H_kv, S, D] -> [B, H, T, D].

    mask: [B or 1, 1 or H, T, S] bool, the keys each query sees; `causal` is only used with
    mask None and T == S (a prefill from an empty cache). One query per row is
    `decode_attention`'s (its folding reads each key once). `softcap`: written out.
    """
    heads, num_new = q.shape[1], q.shape[2]
    if num_new == 1:
        return decode_attention(q.transpose(1, 2), k, v, mask, softcap=softcap).transpose(1, 2)
    if softcap is not None:
        group = heads // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, H, S, D]
        scores = capped((q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5, softcap)  # [B, H, T, S]
        if mask is None and causal:
            mask = torch.ones(num_new, k.shape[2], dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, -torch.inf)
        return scores.softmax(dim=-1).to(q.dtype) @ v
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=heads != k.shape[1]
    )


def attend_alone(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softcap: float | None = None
) -> torch.Tensor:
    """One query over exactly the keys it sees, no mask: q [H, D], k/v [H_kv, S, D] -> [H, D].

    The batch-invariant mode's attention (models/native.py): every query of every row,
    in a prefill or a decode step, alone or beside others, is this one call, so its
    reduction over keys never depends on other rows' lengths or on how its sequence was
    split into steps.
    """
    heads, dim = q.shape
    kv_heads = k.shape[0]
    folded = q.reshape(1, kv_heads, heads // kv_heads, dim)  # [1, H_kv, G, D]
    if softcap is not None:
        scores = capped((folded @ k[None].transpose(-1, -2)).float() * dim**-0.5, softcap)  # [1, H_kv, G, S]
        return (scores.softmax(dim=-1).to(q.dtype) @ v[None]).reshape(heads, dim)
    return F.scaled_dot_product_attention(folded, k[None], v[None]).reshape(heads, dim)
