"""`StaticDecodeLM`: batch-1 decoding through one compiled, static-shape step (issue 15, item 6).

    model = StaticDecodeLM(load_model("shakespeare"))      # compiles on the first decode step
    generate(model, "ROMEO:", SamplingParams(temperature=0))

gpt-fast's recipe on the CPU: a decode step whose shapes never change -- one row, one
token, a KV buffer of fixed `capacity` per layer written at the position (`index_copy_`),
attention over the whole buffer under a position mask, no data-dependent Python -- is
compiled once by `torch.compile(fullgraph=True, dynamic=False)` (inductor: fused C++
kernels around the matmuls), so a token costs a few fused kernels instead of ~100 ATen
calls dispatched from Python. The step is the wrapped model's own `LlamaNet.forward` with
`StaticStep` as its cache, whose `attend` writes the new key and value into the buffers and
calls `decode_attention` (models/attention.py) over the whole buffer under a position mask;
greedy tokens equal `generate`'s on the wrapped model (tests/models/test_static.py).

The wrapper is a `LanguageModel` without paged KV, so `generate` runs it on the plain loop
(decode/sample.py): the prompt is prefilled by the wrapped model's own forward into the
static buffers (`ContiguousKVCache.attend` over `StaticKVCache.layer`), then every one-token
step of an unpadded single row is the compiled step. Anything else (several rows, n > 1
after the fork, padding) falls back to the wrapped model and an ordinary
`ContiguousKVCache`. The KV buffers are one tensor per layer, not one stacked tensor:
`index_copy_` into a view of a compiled graph's input makes inductor copy the whole
stacked buffer back every step (measured: 0.5-1.1 ms of a 1.8 ms step on `shakespeare`,
which made the compiled step slower than the eager one).

What it costs: the compilation (10-90 s on the first step, inductor caches it on disk), and
attention over `capacity` positions at every step whatever the length (keep `capacity` near
the lengths you generate). What it pays: BENCHMARKS.md, "Real model shapes: dtype, device
and speed" (`python benchmarks/static_decode.py`). Refused: sliding-window layers, dynamic
RoPE (its tables change with the length), mixtures of experts and the batch-invariant mode.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch

from decodekit.models.attention import decode_attention
from decodekit.models.base import Cache, LanguageModel
from decodekit.models.contiguous_kv import ContiguousKVCache
from decodekit.models.native import NativeLM

Step = Callable[[torch.Tensor, torch.Tensor, list, list], torch.Tensor]


class StaticKVCache(ContiguousKVCache):
    """One row's keys and values in a fixed-capacity [1, H_kv, C, D] tensor per layer."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):  # fmt: skip
        shape = (1, num_kv_heads, capacity, head_dim)
        self.key_layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value_layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.slots = torch.zeros((1, capacity), dtype=torch.bool, device=device)
        self.next_position = torch.zeros(1, dtype=torch.long, device=device)
        self._length = 0
        self.has_padding = False

    @property
    def batch_size(self) -> int:
        return 1

    @property
    def capacity(self) -> int:
        return self.slots.shape[1]

    def reserve(self, length: int) -> None:
        if length > self.capacity:
            raise ValueError(f"{length} positions do not fit the static decode capacity of {self.capacity}")

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """ContiguousKVCache.attend's storage (the prefill path): this layer's own buffers."""
        return self.key_layers[layer], self.value_layers[layer]

    def fork(self, rows: Sequence[int]) -> ContiguousKVCache:
        """Another StaticKVCache for one row; an ordinary ContiguousKVCache for several."""
        index = self._row_index(rows)
        with torch.inference_mode():
            if len(index) == 1:
                other = StaticKVCache.__new__(StaticKVCache)
                other.key_layers = [t.clone() for t in self.key_layers]
                other.value_layers = [t.clone() for t in self.value_layers]
            else:
                other = ContiguousKVCache.__new__(ContiguousKVCache)
                other.keys = torch.stack(self.key_layers)[:, index]  # [N, R, H_kv, C, D]
                other.values = torch.stack(self.value_layers)[:, index]
            other.slots = self.slots[index]
            other.next_position = self.next_position[index]
        other._length, other.has_padding = self._length, self.has_padding
        return other

    def select(self, rows: Sequence[int]) -> None:
        self._row_index(rows)  # one row: [0] is the only selection there is
        if len(rows) != 1:
            raise ValueError(f"a StaticKVCache holds one row; cannot select rows {list(rows)}")


class StaticStep:
    """The cache `LlamaNet.forward` attends through in the static step: one row, one token at
    `position` (a tensor: the step's shapes and Python never depend on it)."""

    def __init__(self, keys: list, values: list, position: torch.Tensor, visible: torch.Tensor):
        self.keys, self.values = keys, values  # per layer [1, H_kv, C, D], written in place
        self.position, self.visible = position, visible  # [1], [1, 1, 1, C] bool

    def attend(self, layer, q, k, v, mask, causal, per_query=False, softcap=None) -> torch.Tensor:
        """q [1, 1, H, D], k/v [1, 1, H_kv, D] -> [1, 1, H, D]."""
        keys, values = self.keys[layer], self.values[layer]
        keys.index_copy_(2, self.position, k.transpose(1, 2))
        values.index_copy_(2, self.position, v.transpose(1, 2))
        return decode_attention(q, keys, values, self.visible, softcap=softcap)


def decode_step(model: NativeLM, capacity: int) -> Step:
    """step(token [1, 1], position [1], keys, values) -> logits [1, 1, V] float32: the
    model's own forward (`LlamaNet.forward`) over `StaticStep`; keys/values: the
    StaticKVCache's per-layer buffers, written at `position` in place."""
    net = model.net
    cos_table, sin_table = model.rope.tables(capacity)
    columns = torch.arange(capacity, device=model.device)
    masks = [(None, False)] * model.config.num_layers  # StaticStep masks by itself

    def step(token, position, keys, values):
        cos = cos_table.index_select(0, position)[None, :, None]  # [1, 1, 1, D]
        sin = sin_table.index_select(0, position)[None, :, None]
        visible = (columns <= position)[None, None, None, :]  # [1, 1, 1, C]
        return net(token, cos, sin, StaticStep(keys, values, position, visible), masks)

    return step


class StaticDecodeLM(LanguageModel):
    """A NativeLM whose single-row decode steps run one compiled static-shape step (module
    docstring). capacity: KV positions per layer (default the model's context, at most
    1,024); it is also this model's `max_context`. compile=False runs the same step eagerly."""

    supports_paged_kv = False  # the plain loop: one row's steps are this model's own

    def __init__(self, model: NativeLM, capacity: int | None = None, compile: bool = True):
        if not isinstance(model, NativeLM):
            raise TypeError(f"StaticDecodeLM wraps a NativeLM, got {type(model).__name__}")
        if model.batch_invariant:
            raise ValueError("StaticDecodeLM does not run the batch-invariant mode")
        if any(window is not None for window in model.layer_windows()):
            raise ValueError("StaticDecodeLM does not run sliding-window attention layers")
        if model.config.num_experts:
            raise ValueError("StaticDecodeLM does not run a mixture of experts (its experts are picked on "
                             "the host)")
        if model.config.rope.threshold is not None:
            raise ValueError(f"StaticDecodeLM does not run {model.config.rope.kind} RoPE (its tables change "
                             "with the length)")
        capacity = min(model.max_context, 1024) if capacity is None else capacity
        if not 1 <= capacity <= model.max_context:
            raise ValueError(f"capacity must be in [1, {model.max_context}] (the context), got {capacity}")
        self.model, self.capacity, self.compile = model, capacity, compile
        self.name, self.tokenizer = model.name, model.tokenizer
        self.vocab_size, self.eos_token_ids = model.vocab_size, model.eos_token_ids
        self.max_context = capacity
        self.steps = 0  # one-token steps run by the static step (the others: the wrapped model)
        self._eager = decode_step(model, capacity)
        self._step: Step | None = None

    def new_cache(self, batch_size: int) -> ContiguousKVCache:
        if batch_size != 1:
            return self.model.new_cache(batch_size)
        config = self.model.config
        return StaticKVCache(config.num_layers, config.num_kv_heads, config.head_dim, self.capacity,
                             self.model.dtype, self.model.device)  # fmt: skip

    def num_parameters(self) -> int:
        return self.model.num_parameters()

    def encode(self, text: str) -> list[int]:
        return self.model.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.model.decode(ids)

    def hidden_states(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.hidden_states(tokens, mask)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: Cache, mask: torch.Tensor | None = None) -> torch.Tensor:
        static = (isinstance(cache, StaticKVCache) and tokens.shape == (1, 1) and not cache.has_padding
                  and (mask is None or bool(mask.all())))  # fmt: skip
        if not static:
            return self.model.forward(tokens, cache, mask)
        position = cache.length
        cache.append(None, 1)  # raises past the capacity
        self.steps += 1
        args = (tokens.to(self.model.device), torch.tensor([position], device=self.model.device),
                cache.key_layers, cache.value_layers)  # fmt: skip
        if self._step is not None:
            return self._step(*args)
        self._step = self._eager
        if self.compile:  # compiled on this first call; a failure falls back to the eager step
            compiled = torch.compile(self._eager, fullgraph=True, dynamic=False)
            try:
                logits = compiled(*args)
            except Exception as error:  # noqa: BLE001 (no C++ compiler, an unsupported platform)
                warnings.warn(f"StaticDecodeLM: torch.compile failed, decoding eagerly: {error}",
                              stacklevel=2)  # fmt: skip
            else:
                self._step = compiled
                return logits
        return self._step(*args)
