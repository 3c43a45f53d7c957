"""One engine step's forward: every scheduled token in one flat row, attention per sequence.

The sequences of a step (one new token for each decoding sequence, the prompt of each
prefilling one) are concatenated into a single row `[1, T]` with no padding, so every
linear layer runs once over all T tokens (nano-vllm's layout). `PagedBatch` is what
NativeLM's layers receive as their cache: its `attend` writes the new keys and values into
the block pool and computes each sequence's attention:

- the decoding sequences, first in the row and in the order of their `RunningKV` rows,
  attend together in one `decode_attention` call over the dense rows `[:B, :, :S]` (rows.py;
  S is the longest, a mask hides the rest of shorter rows); the samples of one prompt also
  attend to its shared prefix, once for all of them (cascade attention, `SharedKV`);
- each other sequence (a prompt, or a sequence not in `RunningKV`) attends causally over
  its blocks gathered from the pool, its cached prefix included (`prefill_attention`); the
  short ones among them (a program's verification or draft feeds: a few new tokens after a
  long cached prefix) attend together, padded, in one call (`SpanGroup`), since sixteen
  calls of five queries cost more in overhead than in arithmetic.

A sliding-window layer (`windows`) masks the positions that fell out of each query's
window. In the batch-invariant mode (`paged_forward(..., batch_invariant=True)`) every
query, decoding or prefilling, attends alone over exactly its visible keys
(`attend_alone`) and the rows hold their whole sequence (no shared prefix), so a
token's arithmetic is the same whatever else shares the step.

The layers themselves are NativeLM's (models/native.py) and the attention is
models/attention.py's, as in the compiled and static steps: one implementation of the maths.
This module only says where each query's keys are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decodekit.engine.block_pool import BlockPool, BlockTable, PoolCorrupted
from decodekit.engine.rows import RunningKV, SharedPrefix
from decodekit.models.attention import SharedKV, attend_alone, decode_attention, prefill_attention
from decodekit.models.contiguous_kv import causal_mask
from decodekit.models.native import NativeLM


@dataclass
class PrefillSpan:
    start: int  # first position of the sequence's new tokens in the flat row
    end: int
    blocks: torch.Tensor  # [nb] its block table
    length: int  # positions stored after this step (cached prefix + new tokens)


# Spans of at most this many new tokens attend together (`SpanGroup`); longer ones (prompts)
# alone, where padding to the longest would waste more than a call costs.
SHORT_SPAN = 8


@dataclass
class SpanGroup:
    """Short spans attended in one padded call: B spans of at most T new tokens each."""

    queries: torch.Tensor  # [B * T] each padded query's index in the step's row (padding
    #                        repeats its span's last query, so no row of the mask is empty)
    real: torch.Tensor  # [n] which of the B * T padded queries are real
    positions: torch.Tensor  # [n] their indices in the step's row
    blocks: torch.Tensor  # [B * nb] the spans' block tables, padded with their first block
    mask: torch.Tensor  # [B, 1, T, S] bool: the keys each query sees (causal, own span)


@dataclass
class RunningRows:
    """The decoding rows of a step: rows 0..B-1 of `kv`, one new token each."""

    kv: RunningKV
    columns: torch.Tensor  # [B] where each row's new position goes
    # per sliding window (None: full attention), [B, 1, 1, S] positions each row sees;
    # None when every row sees all S
    masks: dict[int | None, torch.Tensor | None]
    width: int  # S, the longest row
    groups: list[tuple[SharedPrefix, torch.Tensor]]  # each shared prefix and its rows [n]


class PagedBatch:
    """The attention backend of one step (see the module docstring)."""

    def __init__(
        self,
        pool: BlockPool,
        slots: torch.Tensor,  # [T] pool slot of every new token
        running: RunningRows | None,
        prefills: list[PrefillSpan],
        windows: tuple[int | None, ...] = (),
        end: int = 0,
        lengths: list[int] | None = None,  # [T] each token's sequence length after the step
    ):
        self.pool = pool
        self.end = end  # 1 + the step's largest position, known on the host (no read of `positions`)
        self.lengths = lengths  # dynamic RoPE's frequencies, per row (paged_forward)
        self.slots = slots
        self.running = running
        self.prefills = prefills
        self.windows = windows  # each layer's sliding window; () when none slides
        self.group, self.alone = group_short_spans(prefills, pool.block_size, windows)

    def attend(self, layer, q, k, v, mask, causal, per_query=False, softcap=None) -> torch.Tensor:
        """q [1, T, H, D], k/v [1, T, H_kv, D] -> [1, T, H, D]; mask/causal are unused.
        per_query: the batch-invariant mode (module docstring); softcap: the scores' cap
        (models/attention.py)."""
        window = self.windows[layer] if self.windows else None
        pool = self.pool
        # k, v as stored (a quantised pool's round trip): the running rows hold the same
        k, v = pool.write(layer, self.slots, k[0].transpose(0, 1), v[0].transpose(0, 1))
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [T, H_kv, D]
        decoding = len(self.running.columns) if self.running is not None else 0
        if decoding and not self.prefills:  # each token its own row: [1, B, H, D] <-> [B, 1, H, D]
            return self._decode(layer, q.transpose(0, 1), k, v, window, per_query, softcap).transpose(0, 1)
        out = torch.empty_like(q[0])  # [T, H, D]
        if decoding:
            out[:decoding] = self._decode(
                layer, q[0, :decoding, None], k[:decoding], v[:decoding], window, per_query, softcap
            )[:, 0]
        alone = self.prefills
        if self.group is not None and not per_query:
            out[self.group.positions] = _attend_together(q[0], pool, layer, self.group, softcap)
            alone = self.alone
        for span in alone:
            out[span.start : span.end] = _prefill(
                q[0, span.start : span.end], pool, layer, span, window, per_query, softcap
            )
        return out[None]

    def _decode(self, layer: int, q, k, v, window: int | None, per_query: bool,
                softcap: float | None = None) -> torch.Tensor:  # fmt: skip
        """q [B, 1, H, D], k/v [B, H_kv, D] of the running rows -> [B, 1, H, D]."""
        running = self.running
        batch = q.shape[0]
        row_keys = running.kv.keys[layer]  # [R, H_kv, C, D]
        row_values = running.kv.values[layer]
        rows = torch.arange(batch, device=q.device)
        row_keys[rows, :, running.columns] = k  # [B, H_kv, D] at each row's new position
        row_values[rows, :, running.columns] = v
        if per_query:
            assert not running.groups  # the rows hold their whole sequences
            out = torch.empty_like(q)
            for row, length in enumerate(running.kv.lengths[:batch]):
                first = max(0, length - window) if window is not None else 0
                keys, values = row_keys[row, :, first:length], row_values[row, :, first:length]
                out[row, 0] = attend_alone(q[row, 0], keys, values, softcap)  # [H, D]
            return out
        assert window is None or not running.groups  # no shared prefix in a sliding-window model
        width = running.width  # the longest row
        prefixes = [SharedKV(p.keys[layer], p.values[layer], rows) for p, rows in running.groups]
        return decode_attention(q, row_keys[:batch, :, :width], row_values[:batch, :, :width],
                                running.masks[window], prefixes=prefixes, softcap=softcap)  # fmt: skip


def group_short_spans(
    spans: list[PrefillSpan], block_size: int, windows: tuple[int | None, ...]
) -> tuple[SpanGroup | None, list[PrefillSpan]]:
    """The spans of at most SHORT_SPAN new tokens as one `SpanGroup` (None if fewer than two,
    or if a layer slides), and the others."""
    short = [span for span in spans if span.end - span.start <= SHORT_SPAN]
    if len(short) < 2 or any(w is not None for w in windows):
        return None, spans
    device = short[0].blocks.device  # beside the pool the indices index
    # The spans' sizes are host numbers: the group's indices are built on the host and
    # uploaded once each (no read of a device tensor).
    counts = [span.end - span.start for span in short]
    count, width = max(counts), max(span.length for span in short)  # T, S
    offsets = [[min(t, new - 1) for t in range(count)] for new in counts]  # [B, T]
    queries = [span.start + t for span, row in zip(short, offsets) for t in row]
    real = [b * count + t for b, new in enumerate(counts) for t in range(new)]
    seen = to_device([[span.length - new + t for t in row]
                      for span, new, row in zip(short, counts, offsets)], device)  # [B, T]
    mask = (torch.arange(width, device=device)[None, None, :] <= seen[:, :, None])[:, None]  # [B, 1, T, S]
    num_blocks = -(-width // block_size)
    padded = [torch.cat([s.blocks, s.blocks[:1].expand(num_blocks - len(s.blocks))]) for s in short]
    group = SpanGroup(to_device(queries, device), to_device(real, device),
                      to_device([queries[i] for i in real], device), torch.cat(padded), mask)
    grouped = set(map(id, short))
    return group, [span for span in spans if id(span) not in grouped]


def _attend_together(q: torch.Tensor, pool: BlockPool, layer: int, group: SpanGroup,
                     softcap: float | None = None) -> torch.Tensor:  # fmt: skip
    """q [T_all, H, D] of the step -> [n, H, D] for the group's real queries."""
    batch, _, count, width = group.mask.shape
    heads, dim = q.shape[1:]
    keys, values = pool.read(group.blocks, layer)  # [H_kv, B * nb * block_size, D]
    kv_heads = keys.shape[0]
    k = keys.view(kv_heads, batch, -1, dim)[:, :, :width]
    v = values.view(kv_heads, batch, -1, dim)[:, :, :width]
    padded = q[group.queries].view(batch, count, heads, dim).transpose(1, 2)  # [B, H, T, D]
    out = prefill_attention(padded, k.transpose(0, 1), v.transpose(0, 1), group.mask, causal=False,
                            softcap=softcap)  # fmt: skip
    return out.transpose(1, 2).reshape(batch * count, heads, dim)[group.real]


def _prefill(
    q: torch.Tensor, pool: BlockPool, layer: int, span: PrefillSpan, window: int | None,
    per_query: bool, softcap: float | None = None,
) -> torch.Tensor:
    """q [T_i, H, D] of one sequence -> [T_i, H, D], causal over its blocks."""
    num_new = q.shape[0]
    keys, values = pool.read(span.blocks, layer)  # [H_kv, nb * block_size, D]
    k, v = keys[:, : span.length], values[:, : span.length]
    start = span.length - num_new
    if per_query:
        out = torch.empty_like(q)
        for t in range(num_new):
            end = start + t + 1  # the query's position + 1
            first = max(0, end - window) if window is not None else 0
            out[t] = attend_alone(q[t], k[:, first:end], v[:, first:end], softcap)
        return out
    slides = window is not None and span.length > window
    mask = None
    if (start and num_new > 1) or slides:  # one query after its prefix sees every key: no mask
        mask = causal_mask(start, num_new, window if slides else None, q.device)[None, None]  # [1, 1, T, S]
    causal = mask is None and start == 0
    out = prefill_attention(q.transpose(0, 1)[None], k[None], v[None], mask, causal=causal, softcap=softcap)
    return out[0].transpose(0, 1)  # [T, H, D]


@torch.inference_mode()
def paged_forward(
    model: NativeLM,
    tokens: torch.Tensor,  # [T] every scheduled token
    positions: torch.Tensor,  # [T] their positions in their sequences
    batch: PagedBatch,
    keep: torch.Tensor,  # [K] flat indices whose logits are wanted
    batch_invariant: bool = False,
    states: bool = False,
):
    """Logits [K, V] float32 of the kept positions. batch_invariant: every linear layer
    per token and every query alone (module docstring; models/native.py). states: also
    their final hidden states (after the final norm, what the LM head read), (logits,
    states [K, hidden] float32), for an adapter that reads them (align/qvalue.py)."""
    assert batch.windows == model.config.layer_windows, "build_batch(windows=...) of this model"
    end = batch.end or int(positions.max()) + 1
    model.check_positions(end)
    if model.config.rope.threshold is not None:  # each token's frequencies from its own row's length
        lengths = to_device(batch.lengths, positions.device)
        cos, sin = model.rope.at(positions, lengths)
    else:
        cos, sin = model.rope.tables(end)
        cos, sin = cos[positions], sin[positions]
    cos, sin = cos[None, :, None], sin[None, :, None]  # [1, T, 1, D]
    masks = [(None, False)] * model.config.num_layers  # PagedBatch masks by itself
    out = model.net(tokens[None], cos, sin, batch, masks, keep, batch_invariant, states)
    return (out[0][0], out[1][0]) if states else out[0]


def build_batch(
    pool: BlockPool,
    items: list[tuple[BlockTable, list[int], list[int]]],
    running: RunningKV | None = None,
    windows: tuple[int | None, ...] = (),
    every: list[bool] | None = None,
):
    """tokens [T], positions [T], the PagedBatch and kept indices [K] of a step.

    items: per sequence, its table (already holding `len(slots)` reserved positions), its
    tokens (at least `table.length` of them) and the pool slots of its new positions. With
    `running`, the first len(running) items are its rows 0..B-1 in order (one new token
    each, `running.grow` already called). Each item's last new token's logits are kept,
    in the order of `items`, or all of its new tokens' where `every[i]` (a program's
    verification: program.py). windows: the model's `config.layer_windows`.
    """
    device = pool.keys.device  # every index lives beside the KV it indexes
    tokens: list[int] = []
    positions: list[int] = []
    all_slots: list[int] = []
    lengths: list[int] = []  # each token's sequence length after this step (dynamic RoPE)
    keep: list[int] = []
    prefills: list[PrefillSpan] = []
    decoding = len(running) if running is not None else 0
    for index, (table, seq_tokens, slots) in enumerate(items):
        count, length = len(slots), table.length
        start = len(tokens)
        tokens += seq_tokens[length - count : length]
        positions += range(length - count, length)
        all_slots += slots
        if every is not None and every[index]:
            keep += range(start, start + count)
            # a verification's tokens as decoding would have fed them one by one: each with
            # its own length's frequencies (dynamic RoPE; a prompt shares its forward's length)
            lengths += range(length - count + 1, length + 1)
        else:
            lengths += [length] * count
            keep.append(start + count - 1)
        if index < decoding and (count != 1 or running.total_length(index) != length):
            # a row's KV and its table disagree: the step would attend over the wrong keys
            raise PoolCorrupted(f"RunningKV row {index} holds {running.total_length(index)} positions "
                                f"and feeds {count} tokens; its table holds {length}, and a row feeds one")
        if index >= decoding:
            blocks = to_device(table.blocks, device)
            prefills.append(PrefillSpan(start, start + count, blocks, length))
    rows = None
    if decoding:
        rows = _running_rows(running, set(windows) or {None})

    # the step's indices in one copy to the device: tokens, positions, slots [T] and keep [K]
    flat = to_device(tokens + positions + all_slots + keep, device)
    tokens_t, positions_t, slots_t, keep_t = flat.split([len(tokens)] * 3 + [len(keep)])
    batch = PagedBatch(pool, slots_t, rows, prefills, windows, max(positions, default=-1) + 1, lengths)
    return tokens_t, positions_t, batch, keep_t


def to_device(numbers: list, device: torch.device) -> torch.Tensor:
    """Host integers (a list, or a list of equal lists) as a long tensor on `device`. On a
    GPU the copy is asynchronous, from pinned memory (the caching host allocator keeps it
    until the copy is done): a step's inputs cost no synchronisation of the host."""
    if device.type != "cuda":
        return torch.tensor(numbers, dtype=torch.long, device=device)
    return torch.tensor(numbers, dtype=torch.long).pin_memory().to(device, non_blocking=True)


def _running_rows(running: RunningKV, windows: set[int | None]) -> RunningRows:
    device = running.keys.device
    lengths = to_device(running.lengths, device)  # [B] each row's own positions
    width = max(running.lengths)
    groups: dict[int, tuple[SharedPrefix, list[int]]] = {}
    for row, prefix in enumerate(running.prefixes):
        if prefix is not None:
            groups.setdefault(id(prefix), (prefix, []))[1].append(row)
    masks: dict[int | None, torch.Tensor | None] = {}
    columns = torch.arange(width, device=device)[None, :]  # [1, S]
    for window in windows:
        first = lengths - window if window is not None else torch.zeros_like(lengths)
        # from the host's lengths: reading the device's would synchronise every step
        if min(running.lengths) == width and (window is None or width - window <= 0):
            masks[window] = None
            continue
        mask = ((columns < lengths[:, None]) & (columns >= first[:, None]))[:, None, None, :]
        if groups:  # the LSE-returning kernel takes an additive mask [B, 1, 1, S]
            mask = running.keys.new_zeros(mask.shape).masked_fill(~mask, -torch.inf)
        masks[window] = mask
    shared = [(prefix, to_device(rows, device)) for prefix, rows in groups.values()]
    return RunningRows(running, lengths - 1, masks, width, shared)
