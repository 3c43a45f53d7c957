"""A contiguous key/value cache and the attention function that reads it (NativeLM).

One tensor per side holds every layer, `[layers, B, H_kv, capacity, D]`, so fork, select
and growth are one indexing op each rather than a loop over layers. Capacity doubles
when full (amortised O(1) appends, as a Python list does). `mask [B, capacity]` marks
real tokens; left padding keeps its slot but is never attended to and never counts
towards a row's position (ARCHITECTURE.md, LanguageModel contract).

`CompressedKVCache` is an evaluation cache for seed 001's KV-cache compression: its keys
and values round-trip through a storage dtype (bfloat16, or int8 with `quantize_int8`, as
the engine's block pool stores them) and, with a token budget, a query sees only the first
`sinks` positions and the most recent ones (StreamingLLM's cache, `streaming_mask`), or
the heavy hitters and the most recent ones (H2O, `heavy_hitter_attention`).

This is the simple engine-less cache; the paged engine (issue 4, item 2) replaces it
behind the same `Cache` operations. Each cache's `attend` stores a layer's new keys and
values and calls the attention of models/attention.py, as every other cache does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decodekit.models.attention import attend_alone, prefill_attention
from decodekit.models.base import Cache

_MIN_CAPACITY = 16


class ContiguousKVCache(Cache):
    """Per-layer keys and values of B rows, with per-row positions and a padding mask."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        capacity: int = _MIN_CAPACITY,
        device: str | torch.device = "cpu",
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        shape = (num_layers, batch_size, num_kv_heads, max(capacity, 1), head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [N, B, H_kv, C, D]
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # [N, B, H_kv, C, D]
        # [B, C] real tokens, [B] real tokens so far
        self.slots = torch.zeros((batch_size, shape[3]), dtype=torch.bool, device=device)
        self.next_position = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._length = 0
        # True once any slot below `length` is padding: then rows need their own positions
        # and an explicit attention mask; otherwise the fast shared-position path applies.
        self.has_padding = False

    @property
    def length(self) -> int:
        return self._length

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def mask(self) -> torch.Tensor:
        """Real-token mask of the cached positions, [B, length] bool."""
        return self.slots[:, : self._length]

    @torch.inference_mode()
    def reserve(self, length: int) -> None:
        """Make room for `length` positions, doubling the capacity as needed."""
        if length <= self.capacity:
            return
        capacity = max(length, 2 * self.capacity, _MIN_CAPACITY)
        self.keys = _grow(self.keys, capacity, self._length)
        self.values = _grow(self.values, capacity, self._length)
        slots = self.slots.new_zeros((self.batch_size, capacity))
        slots[:, : self._length] = self.mask
        self.slots = slots

    @torch.inference_mode()
    def append(self, mask: torch.Tensor | None, count: int) -> None:
        """Record `count` new positions (mask [B, count] bool, None = all real)."""
        self.reserve(self._length + count)
        end = self._length + count
        if mask is None:
            self.slots[:, self._length : end] = True
            self.next_position += count
        else:
            self.slots[:, self._length : end] = mask
            self.next_position += mask.sum(dim=1)
            self.has_padding = True
        self._length = end

    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # [B, T, H, D], rotated
        k: torch.Tensor,  # [B, T, H_kv, D], rotated
        v: torch.Tensor,  # [B, T, H_kv, D]
        mask: torch.Tensor | None,
        causal: bool,
        per_query: bool = False,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Store layer `layer`'s new keys/values at the last T positions, attend: [B, T, H, D].

        per_query: each query alone over the keys its row of `mask` shows (the
        batch-invariant mode, models/native.py; `mask` is then never None). softcap: the
        scores' cap (models/attention.py).
        """
        end = self._length
        start = end - q.shape[1]
        keys, values = self.layer(layer)  # [B, H_kv, C, D]
        keys[:, :, start:end] = k.transpose(1, 2)
        values[:, :, start:end] = v.transpose(1, 2)
        keys, values = keys[:, :, :end], values[:, :, :end]
        if per_query:
            assert mask is not None
            return _attend_per_query(q, keys, values, mask, softcap)
        return prefill_attention(q.transpose(1, 2), keys, values, mask, causal, softcap).transpose(1, 2)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values, views [B, H_kv, capacity, D]."""
        return self.keys[layer], self.values[layer]

    def fork(self, rows: Sequence[int]) -> ContiguousKVCache:
        index = self._row_index(rows)
        other = ContiguousKVCache.__new__(ContiguousKVCache)
        with torch.inference_mode():
            # Copy only the filled part; the fork keeps the parent's capacity for its own growth.
            other.keys = _take_rows(self.keys, index, self._length)
            other.values = _take_rows(self.values, index, self._length)
            other.slots = self.slots[index]
            other.next_position = self.next_position[index]
        other._length = self._length
        other.has_padding = self.has_padding
        other._refresh_padding()
        return other

    def select(self, rows: Sequence[int]) -> None:
        index = self._row_index(rows)
        with torch.inference_mode():
            self.keys = self.keys[:, index]
            self.values = self.values[:, index]
            self.slots = self.slots[index]
            self.next_position = self.next_position[index]
        self._refresh_padding()

    def crop(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"crop length must be in [0, {self._length}], got {length}")
        with torch.inference_mode():
            self.slots[:, length:] = False
            self._length = length
            self.next_position = self.mask.sum(dim=1)
        self._refresh_padding()

    def _row_index(self, rows: Sequence[int]) -> torch.Tensor:
        rows = list(rows)
        if not rows or any(not 0 <= r < self.batch_size for r in rows):
            raise ValueError(
                f"rows must be a non-empty list of ints in [0, {self.batch_size}), got {rows}"
            )
        return torch.tensor(rows, dtype=torch.long, device=self.slots.device)

    def _refresh_padding(self) -> None:
        self.has_padding = self.has_padding and not bool(self.mask.all())


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> int8 codes [..., D] and float32 scales [...]: x ~ codes * scale, scale =
    max |x| / 127 over the D values (symmetric absmax), so |x - x'| <= scale / 2."""
    scale = x.abs().amax(dim=-1).float() / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero vector stays zero
    codes = (x.float() / scale[..., None]).round_().clamp_(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., D], scale [...] -> [..., D] in `dtype`."""
    return (codes.float() * scale[..., None]).to(dtype)


def round_trip(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """x as a cache storing it in `kv_dtype` gives it back, in x's dtype."""
    if kv_dtype == x.dtype:
        return x
    if kv_dtype == torch.int8:
        return dequantize_int8(*quantize_int8(x), x.dtype)
    return x.to(kv_dtype).to(x.dtype)


def streaming_mask(
    start: int, num_new: int, sinks: int, recent: int, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """[T, start + T] bool: the keys a query at position start + t keeps in StreamingLLM's cache
    (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks"): the first
    `sinks` positions and the `recent` most recent ones, itself included. Evicting the rest
    for good is this mask, since a key that leaves the recent window never comes back; keys
    keep their original positions (rotated once, as stored)."""
    visible = causal_mask(start, num_new, recent, device)
    visible[:, :sinks] |= causal_mask(start, num_new, device=device)[:, :sinks]
    return visible


def heavy_hitter_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, budget: int, recent: int
) -> torch.Tensor:
    """Causal attention of a whole sequence through H2O's cache (Zhang et al. 2023, "H2O:
    Heavy-Hitter Oracle"): q [B, H, T, D], k/v [B, H_kv, T, D] -> [B, H, T, D], each query
    over the keys `heavy_hitters` keeps for it."""
    kept = heavy_hitters(q, k, budget, recent)  # [B, H_kv, T, T]
    group = q.shape[1] // k.shape[1]
    return prefill_attention(q, k, v, kept.repeat_interleave(group, dim=1), causal=False)


def heavy_hitters(q: torch.Tensor, k: torch.Tensor, budget: int, recent: int) -> torch.Tensor:
    """H2O's eviction: [B, H_kv, T, T] bool, the keys query t still sees (q [B, H, T, D],
    k [B, H_kv, T, D]).

    Each key head keeps at most `budget` keys, the query's own included: once over it, each
    new key evicts for good the key with the least attention accumulated so far (summed
    over the query heads that share it) among those older than the `recent` newest. The
    queries run one at a time, since each eviction depends on the attention the earlier
    ones paid (these weights score keys; the output is `prefill_attention`'s).
    """
    batch, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    folded = q.reshape(batch, kv_heads, heads // kv_heads, length, dim)  # [B, H_kv, G, T, D]
    logits = torch.einsum("bhgtd,bhsd->bhgts", folded.float(), k.float()) / dim**0.5
    kept = torch.ones((batch, kv_heads, length), dtype=torch.bool, device=q.device)
    seen = torch.zeros((batch, kv_heads, length, length), dtype=torch.bool, device=q.device)
    score = torch.zeros((batch, kv_heads, length), device=q.device)
    for t in range(length):
        if t + 1 > budget:  # key t came in, one goes: the lightest older than the recent ones
            older = score[:, :, : t + 1 - recent].masked_fill(~kept[:, :, : t + 1 - recent], torch.inf)
            kept.scatter_(2, older.argmin(dim=-1, keepdim=True), False)
        seen[:, :, t, : t + 1] = kept[:, :, : t + 1]  # `budget` keys at most
        row = logits[:, :, :, t, : t + 1].masked_fill(~kept[:, :, None, : t + 1], -torch.inf)
        score[:, :, : t + 1] += row.softmax(dim=-1).sum(dim=2)
    return seen


POLICIES = ("streaming", "h2o")


class CompressedKVCache(ContiguousKVCache):
    """A `ContiguousKVCache` that stores keys and values as `kv_dtype` would (`round_trip`)
    and, with `budget` set, keeps per query `sinks` + (budget - sinks) recent positions
    (policy "streaming") or budget // 2 heavy hitters + the rest recent ones ("h2o", whole
    sequences in one forward only)."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kv_dtype: torch.dtype | None = None,
        budget: int | None = None,
        sinks: int = 4,
        policy: str = "streaming",
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if budget is not None and not 1 <= sinks + 1 <= budget:
            raise ValueError(f"budget must be at least sinks + 1 = {sinks + 1}, got {budget}")
        if sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {sinks}")
        super().__init__(num_layers, batch_size, num_kv_heads, head_dim, dtype, device=device)
        self.kv_dtype = kv_dtype or dtype
        self.budget = budget
        self.sinks = sinks
        self.policy = policy

    def attend(self, layer, q, k, v, mask, causal, per_query=False, softcap=None) -> torch.Tensor:
        k, v = round_trip(k, self.kv_dtype), round_trip(v, self.kv_dtype)
        if softcap is not None and self.budget is not None:
            raise ValueError("a token budget's attention (streaming, h2o) does not cap scores "
                             "(attn_logit_softcapping)")
        if self.budget is not None and self.length > self.budget:
            if self.has_padding:
                raise ValueError("a token budget needs rows without padding")
            num_new = q.shape[1]
            if self.policy == "h2o":
                if num_new != self.length or per_query:
                    raise ValueError("the h2o policy scores a whole sequence in one forward")
                self.keys[layer, :, :, : self.length] = k.transpose(1, 2)
                self.values[layer, :, :, : self.length] = v.transpose(1, 2)
                recent = self.budget - self.budget // 2
                out = heavy_hitter_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             self.budget, recent)  # fmt: skip
                return out.transpose(1, 2)
            kept = streaming_mask(self.length - num_new, num_new, self.sinks,
                                  self.budget - self.sinks, q.device)[None, None]  # fmt: skip
            mask, causal = (kept if mask is None else mask & kept), False
        return super().attend(layer, q, k, v, mask, causal, per_query, softcap)


def _grow(tensor: torch.Tensor, capacity: int, length: int) -> torch.Tensor:
    grown = tensor.new_zeros((*tensor.shape[:3], capacity, tensor.shape[4]))
    grown[:, :, :, :length] = tensor[:, :, :, :length]
    return grown


def _take_rows(tensor: torch.Tensor, index: torch.Tensor, length: int) -> torch.Tensor:
    taken = tensor.new_zeros((tensor.shape[0], len(index), *tensor.shape[2:]))
    taken[:, :, :, :length] = tensor[:, index, :, :length]
    return taken


def attention_mask(
    cache: ContiguousKVCache, num_new: int, window: int | None = None, explicit: bool = False
) -> torch.Tensor | None:
    """Boolean mask [B or 1, 1, T, S] for the last `num_new` of the cache's S positions, or None.

    None (never when `explicit`) means no mask: with one new token and no padding it
    attends to everything (the fast decode path); with several new tokens into an empty,
    unpadded cache the caller passes `causal=True` to `attend` instead.
    A query may see a key when the key is a real token at or before it and, with a sliding
    `window`, less than `window` positions before it (positions count real tokens only).
    Every query also sees its own slot, so a padding query never has an empty row
    (softmax of all -inf is NaN) -- its output is meaningless but finite, and nothing
    real attends to it.
    """
    total = cache.length
    start = total - num_new
    slides = window is not None and total > window  # else no key can fall out of a window
    if not cache.has_padding:
        if not (slides or explicit) and (num_new == 1 or start == 0):
            return None
        return causal_mask(start, num_new, window, cache.slots.device)[None, None]  # [1, 1, T, S]
    keys = cache.mask  # [B, S]
    visible = keys[:, None, :] & causal_mask(start, num_new, device=keys.device)  # [B, T, S]
    if slides:
        positions = keys.long().cumsum(dim=1) - 1  # [B, S]
        near = positions[:, None, :] > positions[:, start:, None] - window  # [B, T, S]
        visible &= near
    visible[:, :, start:] |= torch.eye(num_new, dtype=torch.bool, device=keys.device)
    return visible[:, None]  # [B, 1, T, S]


def causal_mask(
    start: int, num_new: int, window: int | None = None, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """[T, start + T] bool: query t (at position start + t) sees keys 0 .. start + t, or
    with a sliding window only start + t - window + 1 .. start + t (transformers'
    `sliding_window_overlay`: kv_idx > q_idx - window)."""
    ones = torch.ones((num_new, start + num_new), dtype=torch.bool, device=device)
    visible = ones.tril(diagonal=start)
    if window is not None:
        visible &= ~ones.tril(diagonal=start - window)
    return visible


def _attend_per_query(q, k, v, mask: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    """q [B, T, H, D], k/v [B, H_kv, S, D], mask [B or 1, 1, T, S] -> [B, T, H, D]."""
    out = torch.empty_like(q)
    for row in range(q.shape[0]):
        for t in range(q.shape[1]):
            seen = mask[min(row, mask.shape[0] - 1), 0, t].nonzero()[:, 0]  # [S_seen]
            out[row, t] = attend_alone(q[row, t], k[row][:, seen], v[row][:, seen], softcap)
    return out

