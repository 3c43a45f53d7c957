"""The compiled decode step: the engine's decoding rows through one compiled graph (issue 25).

Most engine steps only decode: every scheduled sequence holds a RunningKV lane (rows.py)
and feeds one token. Eager, such a step costs about a hundred ATen calls dispatched from
Python per layer stack plus `build_batch`'s index tensors; on a small model that overhead,
not arithmetic, is the token's time. vLLM removes it by compiling the model's decode step
and replaying it per batch-size bucket (CUDA graphs); gpt-fast by one static-shape compiled
step (models/static.py). Here:

- `lanes_step(model)` is the decode step over B rows with NativeLM's own modules
  (`LlamaNet.forward` with `LaneAttention` as its cache): tokens [B, 1], positions [B], the
  RunningKV keys and values read-only, and `visible` [B, 1, 1, C] (each row's stored
  positions). Attention is `decode_attention` (models/attention.py), traced in its written-out
  form, over each row and its own new key passed beside it (`new`), so the graph mutates
  nothing; it returns the logits and the new keys and values [N, B, H_kv, D], which the engine
  then writes into the rows and the pool (two index writes for all layers, not two per layer).
- One `torch.compile` per bucket of rows (1, 2, 4, ..., 64; padded rows see nothing and
  their output is dropped), static in B, dynamic in the RunningKV capacity (rows and
  positions), so a bucket compiles once whatever the lengths. The kernels of
  models/kernels.py run inside the graph (their fake kernels: `kernels.register_fakes`).
- Rows that continue a shared prefix (the n samples of a prompt, rows.py) read it once for
  all of them in the graph too: one variant of each bucket also takes the step's prefixes'
  keys and values, one after another [N, 1, H_kv, P, D] (P dynamic), and each row's span of
  them [start, end) (empty for a row of its own), and its queries attend over [its span,
  its row, its new key] with one softmax (the eager step merges the prefix's attention by
  log-sum-exp, rows.py). Several requests' prefixes are joined once and kept while the
  same prefixes run (`PrefixKV`).
- `lanes_step(span=T)`: a step that only verifies speculative spans, T tokens a row, attending
  over the row's keys and causally among themselves (the same `decode_attention`, T queries a
  row), on rows gathered from the pool (compile_policy.py `CompiledSpans`, rows.py
  `GatheredRows`); a member model's one-token forwards (a draft's) run the one-token step over
  such rows (members.py).
- Sliding-window layers mask the columns that fell out of their window (one mask per
  window a step); their verification spans stay eager (engine.py).
- A RoPE whose frequencies change with the length (dynamic NTK, LongRoPE) compiles with its
  tables below the switch; a step with a row past it runs eager.
- Prompts, mixed steps, forks, a quantised KV pool and the batch-invariant mode stay on the
  eager path (`eligible`).

When to compile (`CompilePolicy`, compile_policy.py; the buckets, lanes.py): compilation
costs seconds to a minute (inductor caches its kernels on disk, `TORCHINDUCTOR_CACHE_DIR`, so
a later process pays only the tracing); a step saves a fraction of a millisecond. So the
engine runs eager and compiles a bucket, in
a child process and then between two steps (compile_worker.py: a compilation never runs
beside a step), once the decode-only steps it has already run would have repaid that
bucket's warm-up (a JIT's tiering: past work predicts future work), and automatically only
for buckets of up to 8 rows, where the step is overhead-bound. The warm-up of each bucket of
each model shape is measured and remembered on disk (`compile-times.json` in decodekit's cache directory,
cache_dir.py), so a short
command such as `decodekit generate "ROMEO:"` never waits for a compile. `compile=True`
compiles before the second decode step, in the engine's process, `False` never. A
compilation that fails leaves the engine eager with one warning; a request never fails
for it.
"""

from __future__ import annotations

import types

import torch

from decodekit.models.attention import SharedKV, decode_attention
from decodekit.models.native import NativeLM

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
BACKEND = "inductor"  # torch.compile's backend (the tests also run "aot_eager", which compiles in seconds)
# Before a model's warm-up has been measured on this machine: what a cold compile of a small
# model's step costs on a 2-core CPU (BENCHMARKS.md, "Compiled decode step").
COLD_WARMUP_S = 40.0
# The share of an eager decode step the compiled one saves (1.3-1.5x measured at one row).
ASSUMED_SAVING = 0.3
# The automatic policy compiles buckets up to this many rows: beyond, a step's matmuls and
# attention outweigh its overhead and compiling gained nothing (64 rows: 1.27x against 1.25x
# Hugging Face, BENCHMARKS.md), while a background compile slows a busy server for its length.
AUTO_MAX_ROWS = 8


def bucket(rows: int) -> int | None:
    """The smallest bucket holding `rows`, or None above the largest."""
    return next((b for b in BUCKETS if b >= rows), None)


def bucket_name(size: int, prefixed: bool = False) -> str:
    """A compiled step's name in the policy's records: its rows, and whether it also takes a
    shared prefix (module docstring)."""
    return f"rows={size}" + ("+prefix" if prefixed else "")


class LaneAttention:
    """The cache `LlamaNet.forward` attends through in a compiled step: B rows of one new
    token each over their RunningKV rows, and over a shared prefix for the rows that continue
    it (module docstring). Records the new keys/values."""

    def __init__(self, keys, values, visible, prefix=None, places=None):  # each layer's visible [B, 1, 1, C]
        self.keys, self.values, self.visible = keys, values, visible
        self.prefix = prefix  # None, or keys, values [N, 1, H_kv, P, D] and sees [B, 1, 1, P] bool
        # None: the new keys attend beside the rows (written out, nothing mutated); else each
        # row's index and stored length [B], where the step writes its new key (`lanes_step(writes=)`)
        self.places = places
        self.new_keys: list[torch.Tensor] = []
        self.new_values: list[torch.Tensor] = []

    def attend(self, layer, q, k, v, mask, causal, per_query=False, softcap=None) -> torch.Tensor:
        """q [B, T, H, D], k/v [B, T, H_kv, D] -> [B, T, H, D]; T > 1: a verification span
        (whose rows hold no shared prefix: they are gathered whole, rows.py)."""
        batch, count = q.shape[:2]
        prefixes = ()
        if self.prefix is not None:  # the step's prefixes, joined: each row sees its span
            keys, values, sees = self.prefix
            prefixes = (SharedKV(keys[layer], values[layer], sees=sees),)
        if self.places is not None:  # the new key into its row, then one SDPA kernel over the row
            rows, stored = self.places
            self.keys[layer, rows, :, stored] = k[:, 0]  # [B, H_kv, D]
            self.values[layer, rows, :, stored] = v[:, 0]
            self.new_keys.append(k[:, 0])
            self.new_values.append(v[:, 0])
            keys, values = self.keys[layer, :batch], self.values[layer, :batch]
            # with a shared prefix one softmax over [its span, the row], written out (SDPA does
            # not return the log-sum-exp that merging two parts would need)
            written_out = bool(prefixes)
            return decode_attention(q, keys, values, self.visible[layer], prefixes=prefixes,
                                    written_out=written_out, softcap=softcap)
        # written out (models/attention.py) as dynamo traces it, also when a CUDA graph records
        # it eager: the eager kernels' form would copy every row's keys to append the new one
        out = decode_attention(q, self.keys[layer, :batch], self.values[layer, :batch], self.visible[layer],
                               new=(k, v), prefixes=prefixes, written_out=True, softcap=softcap)  # fmt: skip
        self.new_keys.append(k[:, 0] if count == 1 else k)  # [B, H_kv, D], a span's [B, T, H_kv, D]
        self.new_values.append(v[:, 0] if count == 1 else v)
        return out


def lanes_step(
    model: NativeLM, name: str = "decode_step", prefixed: bool = False, span: int = 1, writes: bool = False
):
    """step(tokens [B, 1], positions [B], stored [B], keys, values [N, R, H_kv, C, D]) ->
    logits [B, V] float32, new keys and values [N, B, H_kv, D] (module docstring). positions:
    each token's position in its sequence (RoPE); stored: the positions its row holds before
    it (a padded row: 0, it sees only its own key). `prefixed`: the step also takes shared
    prefixes' keys and values [N, 1, H_kv, P, D] and each row's span of them, bounds [2, B]
    (start, end; a row that continues a prefix holds only the positions after it).
    `span` T > 1: a verification step, T tokens a row (tokens and positions [B, T]) attending
    causally among themselves (`decode_attention`'s T queries a row); logits [B, T, V], new keys
    and values [N, B, T, H_kv, D].
    `writes` (one token a row): the step writes each row's new key and value into `keys` and
    `values` at its `stored` position and attends over the row with one fused SDPA kernel
    under an additive mask built once for all layers, where the written-out form costs some
    fifteen kernels a layer: a CUDA graph's step (cuda_graphs.py), whose kernels run back to
    back, a few microseconds each however small. With a prefix, its attention over [the
    prefix, the row] is written out (one softmax), the new key already in the row. It returns
    the new keys and values all the same: the engine writes them into the pool, and not again
    into the rows (`GraphedLanes.writes_rows`).

    Each call returns a function with its own code object, called `name`: dynamo keeps its
    compiled graphs per code object, at most 8, so the buckets of every engine in a process
    must not share one."""
    net, config = model.net, model.config
    # A RoPE whose tables change past a switch (dynamic NTK, LongRoPE): the tables below it, the
    # only rows a compiled step takes (compile_policy.py `CompiledDecode`)
    cos_table, sin_table = model.rope.tables(config.rope.threshold or model.max_context)
    masks = [(None, False)] * config.num_layers
    assert not writes or span == 1, "a writing step decodes one token a row"
    # Sliding-window layers (Mistral, Qwen2/3's upper layers, Gemma 3): a row holds its whole
    # sequence (such models share no prefix, rows.py), so its new token at position `stored`
    # sees the columns after stored - window. One mask per window, built once a step.
    windows = model.layer_windows()
    assert span == 1 or not any(windows), "verification spans of sliding layers stay eager"

    def step(tokens, positions, stored, keys, values, prefix_keys=None, prefix_values=None, bounds=None):
        columns = torch.arange(keys.shape[3], device=keys.device)
        places = None
        by_window = {}
        for window in set(windows):
            if writes:  # each row sees its stored positions and the new one: 0 or -inf, in the model's dtype
                hidden = columns[None, :] > stored[:, None]  # [B, C]
                if window is not None:
                    hidden = hidden | (columns[None, :] <= (stored - window)[:, None])
                visible = torch.zeros(hidden[:, None, None].shape, dtype=keys.dtype, device=keys.device)
                by_window[window] = visible.masked_fill_(hidden[:, None, None], -torch.inf)  # [B, 1, 1, C]
            else:
                seen = columns[None, :] < stored[:, None]  # [B, C]
                if window is not None:
                    seen = seen & (columns[None, :] > (stored - window)[:, None])
                by_window[window] = seen[:, None, None]  # [B, 1, 1, C]
        visible = [by_window[window] for window in windows]
        if writes:
            places = (torch.arange(tokens.shape[0], device=keys.device), stored)
        cos = cos_table.index_select(0, positions.reshape(-1)).view(*tokens.shape, 1, -1)  # [B, T, 1, D]
        sin = sin_table.index_select(0, positions.reshape(-1)).view(*tokens.shape, 1, -1)
        prefix = None
        if prefixed:
            spans = torch.arange(prefix_keys.shape[3], device=keys.device)[None, :]  # [1, P]
            sees = (spans >= bounds[0][:, None]) & (spans < bounds[1][:, None])  # [B, P]
            prefix = (prefix_keys, prefix_values, sees[:, None, None])
        cache = LaneAttention(keys, values, visible, prefix, places)
        logits = net(tokens, cos, sin, cache, masks)  # [B, T, V]
        if span > 1:
            return logits, torch.stack(cache.new_keys), torch.stack(cache.new_values)
        return logits[:, 0], torch.stack(cache.new_keys), torch.stack(cache.new_values)

    code = step.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, step.__globals__, name, step.__defaults__, step.__closure__)
