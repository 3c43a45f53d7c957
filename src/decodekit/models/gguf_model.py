"""`load_model("model.gguf")`: a GGUF file (llama.cpp's format) as a NativeLM (issue 27).

The file is read with gguf-py (`gguf.GGUFReader`, llama.cpp's own reader; the `gguf` extra).
Its metadata becomes the config.json dict NativeConfig already parses (`gguf_config`):
`general.architecture` llama, qwen2, qwen3, phi3, gemma, gemma2, gemma3, qwen2moe, qwen3moe,
olmo2 or olmoe
(llama.cpp converts Mistral and SmolLM to "llama", and Mixtral to "llama" with experts; gemma3
is Gemma 3's text model), and under `{arch}.`:
context_length, embedding_length, feed_forward_length, block_count, attention.head_count(_kv),
attention.key_length, attention.layer_norm_rms_epsilon, rope.freq_base, rope.dimension_count
(phi3's partial rotation), rope.scaling.type/factor (no sliding window: llama.cpp runs these
architectures without one, `gguf_config`; gemma2's and gemma3's windows, sliding layers, their
RoPE base and caps as their graphs read them, `gemma_config`). Llama 3's RoPE scaling is the
tensor rope_freqs.weight (`with_frequency_factors`); phi3's LongRoPE the tensors
rope_factors_long/short.weight (`phi3_longrope`); its q/k/v and gate/up are stored fused. Tied
embeddings are a file without `output.weight`; q/k/v and o biases are tensors present.
The tokenizer, its BOS/EOS rules and chat template come from the metadata (gguf_tokenizer.py).

Tensors (gguf_tensors.py): f32/f16/bf16 become the model's dtype, copied once from the file's
mapping into the layout the forward reads (`float_weight`; a file whose matrices are f16 or bf16
runs in float32 on the CPU with them kept as stored, registry.py `half_weights_dtype`); q8_0,
q5_0, Q6_K, q4_0, Q4_K, q4_1 and q5_1 matrices become `QuantizedLinear` layers holding the
blocks' integer codes and scales (and zero points where the type has minimums), so their packed
kernels run the file's own numbers; other block types and quantised embeddings are
dequantised once, at load. A tied embedding on one of those grids is also the output head on
it (a real vocabulary's head is the largest matrix of a small model: Qwen2.5's 151,936 x 896
read in float32 took 40 ms a token on a Zen 4, on its q8_0 grid 5.6 ms), and the lookup
dequantises the rows it reads from the same codes (`QuantizedEmbedding`), so no float copy of
the vocabulary is held.
Where the parts of a fused layer (q/k/v, gate/up) are stored on different grids (Q4_K_M
keeps attn_v in Q6_K beside Q4_K q and k) the layer is a `ConcatLinear` of the parts, so no
part loses its grid.

llama-arch q and k rows were reordered by llama.cpp's converter for ggml's RoPE
(`gguf_tensors.unpermute_rope_rows` undoes it); qwen2/qwen3 use the Hugging Face layout as is.

Errors: a file that is not GGUF, is truncated or is corrupt, an architecture, metadata value
or tensor type NativeLM cannot run, or a missing, unexpected or misshapen tensor raise one
ValueError naming the file and the value, before a model exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from decodekit.models.families import FAMILIES, GGUF_MODEL_TYPES
from decodekit.models.gguf_tensors import FLOAT_TYPES, INTEGER_TYPES, Quantized, decode, unpermute_rope_rows
from decodekit.models.native import LlamaNet, NativeLM, transpose_weight_layout
from decodekit.models.native_config import NativeConfig
from decodekit.models.qlinear import QuantizedEmbedding, QuantizedLinear

MAGIC = b"GGUF"
# GGUF tensor names (llama.cpp's gguf-py `TENSOR_NAMES`) -> NativeLM's, per layer.
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
}  # fmt: skip
# A sandwich-norm block's (Gemma 3): ffn_norm is the MLP's input norm there
SANDWICH_TENSORS = {
    **LAYER_TENSORS, "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}  # fmt: skip
# A post-norm block's (OLMo 2): no input norms, each sublayer's output normed
POST_NORM_TENSORS = {
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}  # fmt: skip
# The MLP gate's activation of llama.cpp's graph of each architecture (ggml_gelu is GELU's tanh form)
GRAPH_ACTIVATIONS = {arch: "gelu_pytorch_tanh" for arch in ("gemma", "gemma2", "gemma3")}
FUSED = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "mlp.gate_up_proj": ("ffn_gate", "ffn_up")}
SINGLE = {"self_attn.o_proj": "attn_output", "mlp.down_proj": "ffn_down"}


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a file that starts with GGUF's magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as handle:
        return handle.read(4) == MAGIC


def read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metadata key -> value, tensor name -> gguf ReaderTensor) of a GGUF file; ValueError
    naming the file when it is not GGUF, is truncated or cannot be parsed."""
    path = Path(path)
    if not is_gguf(path):
        with path.open("rb") as handle:
            start = handle.read(4)
        raise ValueError(f"{path}: not a GGUF file (it starts with {start!r}, GGUF files with {MAGIC!r})")
    from decodekit.optional import require

    gguf = require("gguf", "gguf", "reading GGUF files")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, TypeError) as error:
        raise ValueError(f"{path}: truncated or corrupt GGUF file ({error})") from None
    size = path.stat().st_size
    for tensor in reader.tensors:
        end = tensor.data_offset + tensor.n_bytes
        if end > size or tensor.data.nbytes != tensor.n_bytes:
            raise ValueError(f"{path}: truncated GGUF file: tensor {tensor.name!r} ends at byte {end}, "
                             f"the file has {size}")  # fmt: skip
    meta = {name: field.contents() for name, field in reader.fields.items()}
    return meta, {tensor.name: tensor for tensor in reader.tensors}


def gguf_config(meta: dict[str, Any], tensors: dict[str, Any], where: str) -> dict[str, Any]:
    """The config.json dict of a GGUF file's metadata (module docstring)."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_MODEL_TYPES:
        raise ValueError(f"{where}: general.architecture must be one of {sorted(GGUF_MODEL_TYPES)}, "
                         f"got {arch!r}")
    model_type = GGUF_MODEL_TYPES[arch]

    def value(key: str, default: Any = KeyError) -> Any:
        if f"{arch}.{key}" in meta:
            return meta[f"{arch}.{key}"]
        if default is KeyError:
            raise ValueError(f"{where}: metadata {arch}.{key} is missing")
        return default

    experts = int(value("expert_count", 0))
    if arch == "llama" and experts:
        model_type = "mixtral"  # llama.cpp writes Mixtral as llama with experts
    family = FAMILIES[model_type]
    if family.experts and not experts:
        raise ValueError(f"{where}: metadata {arch}.expert_count must be at least 1 in a {arch} file, got 0")

    hidden, heads = int(value("embedding_length")), int(value("attention.head_count"))
    kv_heads = value("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise ValueError(f"{where}: {arch}.attention.head_count_kv must be one number, got one per layer")
    head_dim = int(value("attention.key_length", hidden // heads))
    rotated = int(value("rope.dimension_count", head_dim))
    rope = {"rope_type": "default", "rope_theta": decimal(value("rope.freq_base", 10000.0))}
    if rotated != head_dim:
        if arch != "phi3":  # phi3's graph rotates the first n_rot dims of each head (NeoX order)
            raise ValueError(f"{where}: {arch}.rope.dimension_count must equal the head size {head_dim} "
                             f"(partial RoPE is read for phi3 only), got {rotated}")  # fmt: skip
        rope["partial_rotary_factor"] = rotated / head_dim
    scaling = value("rope.scaling.type", "none")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=decimal(value("rope.scaling.factor")))
    elif scaling != "none":
        raise ValueError(f"{where}: {arch}.rope.scaling.type must be 'none' or 'linear', "
                         f"got {scaling!r}")
    embedding = tensors.get("token_embd.weight")
    rows = 0 if embedding is None else int(embedding.shape[1])
    vocab = len(meta.get("tokenizer.ggml.tokens") or []) or rows
    config = {
        "model_type": model_type, "architectures": [family.architecture],
        family.activation_key: GRAPH_ACTIVATIONS.get(arch, "silu"),
        "vocab_size": int(value("vocab_size", vocab)), "hidden_size": hidden,
        "intermediate_size": int(value("feed_forward_length")),
        "num_hidden_layers": int(value("block_count")),
        "num_attention_heads": heads, "num_key_value_heads": int(kv_heads), "head_dim": head_dim,
        "rms_norm_eps": decimal(value("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(value("context_length", 2048)), "rope_parameters": rope,
        "attention_bias": "blk.0.attn_q.bias" in tensors or "blk.0.attn_output.bias" in tensors,
        "tie_word_embeddings": "output.weight" not in tensors,
    }  # fmt: skip
    if arch == "phi3":
        rope.update(phi3_longrope(value, tensors, rotated, where))
    # {arch}.attention.sliding_window is not read: llama.cpp's llama, qwen2, qwen3 and phi3 graphs
    # attend over every position (src/models/{llama,qwen2,qwen3}.cpp), so a GGUF file of Mistral
    # 7B v0.1 means full attention, and decodekit runs what the file means. Gemma 2's and 3's
    # graphs read it (src/models/gemma{2,3}.cpp):
    if arch in GEMMA_GRAPHS:
        config.update(gemma_config(arch, value, config))
    if arch == "olmo2" and value("attention.sliding_window", None) is not None:  # OLMo 3's
        raise ValueError(f"{where}: an olmo2 file with attention.sliding_window (OLMo 3) is not supported")
    if experts:
        config.update(experts_config(arch, value, tensors, config))
    return config


# Whether llama.cpp's graph renormalises the chosen experts' weights (src/models/{llama,qwen2moe,
# qwen3moe}.cpp, build_moe_ffn's norm_w), whatever the checkpoint's norm_topk_prob said
NORMALISED_EXPERTS = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}


def experts_config(arch: str, value, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a file's metadata: expert_count, expert_used_count,
    expert_feed_forward_length (Mixtral's experts are feed_forward_length wide), and
    expert_shared_feed_forward_length (qwen2moe's shared expert); a layer without a router
    tensor (ffn_gate_inp) has a plain MLP."""
    layers = config["num_hidden_layers"]
    width = int(value("expert_feed_forward_length", config["intermediate_size"]))
    return {
        "num_experts": int(value("expert_count")), "num_experts_per_tok": int(value("expert_used_count")),
        "moe_intermediate_size": width, "norm_topk_prob": NORMALISED_EXPERTS[arch],
        "shared_expert_intermediate_size": int(value("expert_shared_feed_forward_length", 0)),
        "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors],
    }  # fmt: skip


class GemmaGraph(NamedTuple):
    """What llama.cpp's gemma2 / gemma3 graph assumes where the file has no key
    (src/models/gemma{2,3}.cpp `load_arch_hparams`)."""

    window: int  # attention.sliding_window (0: no sliding layer)
    pattern: int  # attention.sliding_window_pattern: every n-th layer full
    local_base: float | None  # rope.freq_base_swa (None: the full layers' base)
    attn_softcap: float | None  # attn_logit_softcapping (None: no cap, and no key read)
    final_softcap: float | None  # final_logit_softcapping (None: no cap; 0 in the file: none)
    wide_layers: int  # the layer count whose queries scale by 1 / sqrt(hidden / heads) (27B)


GEMMA_GRAPHS = {
    "gemma2": GemmaGraph(window=4096, pattern=2, local_base=None, attn_softcap=50.0, final_softcap=30.0,
                         wide_layers=46),
    "gemma3": GemmaGraph(window=0, pattern=6, local_base=10000.0, attn_softcap=None, final_softcap=None,
                         wide_layers=62),
}  # fmt: skip


def gemma_config(arch: str, value, config: dict[str, Any]) -> dict[str, Any]:
    """The config.json fields of a gemma2 / gemma3 file's metadata as llama.cpp's graph reads
    it (`GEMMA_GRAPHS` where a key is absent): the window and which layers slide
    (attention.sliding_window_pattern, one flag a layer, or every layer but each n-th), the
    sliding layers' RoPE base (gemma3's own, rope.freq_base_swa), the scores' and the final
    logits' caps, and the queries' scale, which the file does not hold: 1 / sqrt(head_dim), but
    1 / sqrt(hidden / heads) for the largest model's layer count (Gemma 2 and 3 27B)."""
    graph = GEMMA_GRAPHS[arch]
    layers = config["num_hidden_layers"]
    window = int(value("attention.sliding_window", graph.window))
    fields: dict[str, Any] = {}
    local_base = value("rope.freq_base_swa", graph.local_base)
    if arch == "gemma3":
        local = {"rope_type": "default", "rope_theta": decimal(local_base)}
        full = {**config["rope_parameters"]}
        fields["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    elif local_base is not None and decimal(local_base) != config["rope_parameters"]["rope_theta"]:
        raise ValueError(f"{arch}.rope.freq_base_swa must equal {arch}.rope.freq_base in a {arch} file, "
                         f"got {decimal(local_base)}")  # fmt: skip
    if window > 0:
        pattern = value("attention.sliding_window_pattern", graph.pattern)
        if isinstance(pattern, list):
            sliding = [bool(flag) for flag in pattern][:layers]
        else:  # llama_hparams::set_swa_pattern
            sliding = [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(layers)]
        fields["sliding_window"] = window
        fields["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    wide = layers == graph.wide_layers
    scalar = config["hidden_size"] // config["num_attention_heads"] if wide else config["head_dim"]
    fields["query_pre_attn_scalar"] = scalar
    if graph.attn_softcap is not None:
        fields["attn_logit_softcapping"] = decimal(value("attn_logit_softcapping", graph.attn_softcap))
    final = decimal(value("final_logit_softcapping", graph.final_softcap or 0.0))
    fields["final_logit_softcapping"] = final or None
    return fields


LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def phi3_longrope(value, tensors: dict[str, Any], rotated: int, where: str) -> dict[str, Any]:
    """A phi3 file's LongRoPE, as llama.cpp's converter stores it: the long and short factors as
    tensors rope_factors_long/short.weight ([n_rot / 2] each), the switch as
    rope.scaling.original_context_length, the cos/sin scale as rope.scaling.attn_factor; {}
    without the factors (Phi-3-mini-4k: plain RoPE). llama.cpp picks one set for its whole
    context; decodekit a row's by its length (models/rope.py)."""
    if not all(name in tensors for name in LONGROPE_TENSORS):
        return {}
    factors = {}
    for name in LONGROPE_TENSORS:
        data = np.asarray(tensors[name].data, dtype=np.float32).reshape(-1)
        if data.shape[0] != rotated // 2:
            raise ValueError(f"{where}: tensor {name!r} has {data.shape[0]} factors, the rotation "
                             f"implies {rotated // 2}")  # fmt: skip
        factors[name] = [decimal(f) for f in data]
    return {"rope_type": "longrope", "long_factor": factors[LONGROPE_TENSORS[0]],
            "short_factor": factors[LONGROPE_TENSORS[1]],
            "original_max_position_embeddings": int(value("rope.scaling.original_context_length")),
            "attention_factor": decimal(value("rope.scaling.attn_factor", 1.0))}  # fmt: skip


def with_frequency_factors(config: NativeConfig, tensors: dict[str, Any], where: str) -> NativeConfig:
    """`config` with the RoPE frequency divisors of tensor rope_freqs.weight, where the file has
    one (Llama 3's scaling as llama.cpp's converter stores it; models/rope.py)."""
    import dataclasses

    tensor = tensors.get("rope_freqs.weight")
    if tensor is None:
        return config
    if tensor.tensor_type.name != "F32":
        raise ValueError(f"tensor 'rope_freqs.weight' must be F32, got {tensor.tensor_type.name}")
    factors = tuple(float(f) for f in np.asarray(tensor.data, dtype=np.float32).reshape(-1))
    return dataclasses.replace(config, rope=dataclasses.replace(config.rope, frequency_factors=factors))


def decimal(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-06, not
    9.99999997e-07): the number config.json held before conversion."""
    return float(str(np.float32(value)))


def stored_dtype(tensors: dict[str, Any]) -> str:
    """The float dtype the file's float matrices are stored in (dtype "auto" starts there):
    "bfloat16" or "float16" where any 2-D tensor is, else "float32"."""
    names = {t.tensor_type.name for t in tensors.values() if len(t.shape) == 2}
    return "bfloat16" if "BF16" in names else "float16" if "F16" in names else "float32"


def half_weights(dtype: str | torch.dtype, tensors: dict[str, Any], device: str | torch.device = "cpu"
                 ) -> torch.dtype | None:  # fmt: skip
    """The type the file's float matrices keep in a float32 model (registry.py
    `half_weights_dtype` of its stored type), or None: also where a float32 matrix sits beside
    the half ones (rounding it to half would change it)."""
    from decodekit.models.registry import half_weights_dtype

    if any(t.tensor_type.name == "F32" for t in tensors.values() if len(t.shape) == 2):
        return None
    return half_weights_dtype(dtype, {"dtype": stored_dtype(tensors)}, device)


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's `malloc_trim(0)`; a no-op
    elsewhere). Loading frees many tensor-sized temporaries (a block type's unpacked codes, a
    fused layer's parts) in the middle of the heap, where glibc keeps them: measured on a 240M
    q4_0 file, they held 2x the model's bytes of resident memory until trimmed."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


class ConcatLinear(nn.Module):
    """A fused projection whose parts keep their own layers (module docstring): x [..., in] ->
    the parts' outputs concatenated, [..., sum of out]."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def float_weight(parts: list[np.ndarray | torch.Tensor | Quantized], dtype: torch.dtype,
                 transposed: bool | None = None) -> torch.Tensor:  # fmt: skip
    """The parts' rows stacked into one weight [N, K] of `dtype`, each part copied once into
    place; a float32 one laid out as the transpose of a contiguous [K, N], the layout
    `native.transpose_weight_layout` gives float32 weights (which then leaves it as it is),
    so no second copy is made (`transposed` False: row-major whatever the dtype). A file's
    array is read straight from its mapping."""
    values = [p.dequantize() if isinstance(p, Quantized) else p for p in parts]
    rows, k = sum(v.shape[0] for v in values), values[0].shape[1]
    transposed = dtype == torch.float32 if transposed is None else transposed
    weight = torch.empty((k, rows) if transposed else (rows, k), dtype=dtype)
    at = 0
    for value in values:
        target = weight[:, at : at + value.shape[0]] if transposed else weight[at : at + value.shape[0]]
        if isinstance(value, np.ndarray) and dtype != torch.bfloat16:
            np.copyto(target.numpy(), value.T if transposed else value, casting="same_kind")
        else:
            value = torch.from_numpy(np.array(value)) if isinstance(value, np.ndarray) else value
            target.copy_(value.T if transposed else value)
        at += value.shape[0]
    return weight.t() if transposed else weight


def linear_layer(
    weight: torch.Tensor | Quantized, bias: torch.Tensor | None, dtype: torch.dtype
) -> nn.Module:
    """An nn.Linear over a float weight [N, K] (in `dtype`, from `float_weight`), or a
    QuantizedLinear over a grid."""
    n, k = weight.shape
    if isinstance(weight, Quantized):
        has_offsets = weight.offsets is not None
        layer = QuantizedLinear(k, n, weight.bits, weight.group_size, bias is not None, has_offsets)
        layer.set_codes(weight.codes, weight.scales, weight.offsets)
        if bias is not None:
            layer.bias.data.copy_(bias.float())
        return layer
    with torch.device("meta"):
        layer = nn.Linear(k, n, bias=bias is not None)
    layer.weight = nn.Parameter(float_weight([weight], dtype) if weight.dtype != dtype else weight,
                                requires_grad=False)  # fmt: skip
    if bias is not None:
        layer.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return layer


def fused_layer(parts: list[torch.Tensor | Quantized], biases: list[torch.Tensor | None],
                dtype: torch.dtype) -> nn.Module:  # fmt: skip
    """One layer for the concatenated parts: float parts, or grids of the same bits and group,
    are concatenated into one; mixed parts become a ConcatLinear."""
    if len({b is None for b in biases}) > 1:
        raise ValueError("a fused layer's parts must all have a bias or none")
    bias = None if biases[0] is None else torch.cat(biases)
    if all(not isinstance(p, Quantized) for p in parts):
        return linear_layer(float_weight(parts, dtype), bias, dtype)
    grids = {(p.bits, p.group_size) if isinstance(p, Quantized) else None for p in parts}
    if len(grids) == 1:
        offsets = None
        if any(p.offsets is not None for p in parts):
            offsets = torch.cat([torch.zeros_like(p.scales) if p.offsets is None else p.offsets
                                 for p in parts])  # fmt: skip
        first = parts[0]
        grid = Quantized(first.bits, first.group_size, torch.cat([p.codes for p in parts]),
                         torch.cat([p.scales for p in parts]), offsets)  # fmt: skip
        return linear_layer(grid, bias, dtype)
    layers = [linear_layer(p if isinstance(p, Quantized) else float_weight([p], dtype), b, dtype)
              for p, b in zip(parts, biases, strict=True)]  # fmt: skip
    return ConcatLinear(layers)


class _Tensors:
    """The file's tensors, each decoded once when taken; names never taken are unexpected."""

    def __init__(self, tensors: dict[str, Any], where: str, config: NativeConfig):
        self.tensors, self.where, self.config = tensors, where, config
        self.taken: set[str] = set()

    def checked(self, name: str, shape: tuple[int, ...], required: bool = True) -> Any:
        """The file's tensor `name`, taken, once its shape is `shape` (None if absent and not
        `required`)."""
        tensor = self.tensors.get(name)
        if tensor is None:
            if required:
                raise ValueError(f"{self.where}: tensor {name!r} is missing")
            return None
        self.taken.add(name)
        stored = tuple(reversed([int(d) for d in tensor.shape]))  # ggml's ne order is [K, N]
        if stored != shape:
            raise ValueError(f"{self.where}: tensor {name!r} has shape {list(stored)}, the metadata "
                             f"implies {list(shape)}")  # fmt: skip
        return tensor

    def take(
        self, name: str, shape: tuple[int, ...], required: bool = True
    ) -> torch.Tensor | Quantized | None:
        tensor = self.checked(name, shape, required)
        if tensor is None:
            return None
        type_name = tensor.tensor_type.name
        raw = tensor.data
        part = name.split(".")[2] if name.startswith("blk.") else ""
        heads = {"attn_q": self.config.num_heads, "attn_k": self.config.num_kv_heads}.get(part)
        if FAMILIES[self.config.model_type].rope_permuted and heads is not None:
            raw = unpermute_rope_rows(np.asarray(raw), heads)
        value = self.decoded(name, raw, type_name, shape)
        if isinstance(value, np.ndarray) and len(shape) == 1:
            return torch.from_numpy(np.array(value))  # vectors (norms, biases): copied now
        return value

    def experts(self, name: str, shape: tuple[int, int, int]) -> list[np.ndarray | Quantized]:
        """A 3-D tensor of experts [E, N, K] (llama.cpp's ffn_*_exps), each expert's matrix
        decoded on its own (a float one still a view of the file's mapping)."""
        tensor = self.checked(name, shape)
        raw = np.asarray(tensor.data)
        kind = tensor.tensor_type.name
        return [self.decoded(name, raw[expert], kind, shape[1:]) for expert in range(shape[0])]

    def decoded(self, name: str, raw: np.ndarray, type_name: str, shape: tuple[int, ...]):
        try:
            return decode(raw, type_name, shape)
        except NotImplementedError:
            supported = ", ".join([*FLOAT_TYPES, *INTEGER_TYPES])
            raise ValueError(f"{self.where}: tensor {name!r} has type {type_name}, which decodekit cannot "
                             f"read (supported: {supported} and what gguf.quants dequantises)") from None

    def float(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, transposed: bool = False
              ) -> nn.Parameter:  # fmt: skip
        """A float parameter: a vector, or a matrix laid out by `float_weight`."""
        value = self.take(name, shape)
        value = float_weight([value], dtype, transposed) if len(shape) == 2 else value.to(dtype)
        return nn.Parameter(value, requires_grad=False)


def load_gguf(path: str | Path, dtype: str | torch.dtype = "auto", name: str | None = None,
              device: str | torch.device = "cpu") -> NativeLM:  # fmt: skip
    """The NativeLM of a GGUF file (module docstring); `dtype` as `load_model`'s, "auto"
    starting from the file's float type (`stored_dtype`)."""
    from decodekit.models.gguf_tokenizer import build_tokenizer, eos_token_ids
    from decodekit.models.half_linear import keep_half_weights
    from decodekit.models.registry import resolve_dtype

    path = Path(path)
    where = str(path)
    meta, tensors = read_gguf(path)
    meta_name = meta.get("general.name")
    config = gguf_config(meta, tensors, where)
    try:
        parsed = NativeConfig.from_dict(config)
        parsed = with_frequency_factors(parsed, tensors, where)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    tokenizer, eos = build_tokenizer(meta, where), eos_token_ids(meta)
    torch_dtype = resolve_dtype(dtype, {"dtype": stored_dtype(tensors)}, device)
    half = half_weights(dtype, tensors, device)
    files = _Tensors(tensors, where, parsed)
    net = _build_net(files, parsed, torch_dtype)
    unexpected = sorted(set(tensors) - files.taken - {"rope_freqs.weight", *LONGROPE_TENSORS})
    if unexpected:
        raise ValueError(f"{where}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all); "
                         "NativeLM has no place for it")  # fmt: skip
    transpose_weight_layout(net)
    if half is not None:  # the file's f16 / bf16 matrices kept as stored (half_linear.py)
        keep_half_weights(net, half)
    del meta, tensors, files  # the last references to the file's mapping
    release_freed_memory()
    model_name = name or str(meta_name or path.stem)
    lm = NativeLM(net, parsed, name=model_name, tokenizer=tokenizer, eos_token_ids=eos)
    return lm.to(device)


def _build_net(files: _Tensors, c: NativeConfig, dtype: torch.dtype) -> LlamaNet:
    """LlamaNet with every weight taken from the file (built on the meta device: nothing is
    initialised, then each tensor assigned)."""
    with torch.device("meta"):
        net = LlamaNet(c)
    hidden, q_width, kv_width = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    embedding = files.take("token_embd.weight", (c.vocab_size, hidden))
    # A tied embedding stored on a grid is the output head on that grid (`QuantizedLinear`: the
    # file's codes, as llama.cpp's output matmul reads them), and the lookup dequantises the rows
    # it reads from them (`QuantizedEmbedding`: no float copy); a tied float32 one is the head
    # itself, laid out as the head's weights are.
    norm_dtype = torch.float32 if c.norm_shift else dtype  # a shifted (1 + w) stays float32 (native.py)
    net.norm.weight = files.float("output_norm.weight", (hidden,), norm_dtype)
    if c.tie_word_embeddings and isinstance(embedding, Quantized):
        net.lm_head = linear_layer(embedding, None, dtype)
        net.embed_tokens = QuantizedEmbedding(net.lm_head, dtype)
    else:
        transposed = c.tie_word_embeddings and dtype == torch.float32
        weight = float_weight([embedding], dtype, transposed)
        net.embed_tokens.weight = nn.Parameter(weight, requires_grad=False)
        if c.tie_word_embeddings:
            net.lm_head.weight = net.embed_tokens.weight
        else:
            net.lm_head = linear_layer(files.take("output.weight", (c.vocab_size, hidden)), None, dtype)
    widths = {"attn_q": q_width, "attn_k": kv_width, "attn_v": kv_width, "attn_output": hidden,
              "ffn_gate": c.intermediate_size, "ffn_up": c.intermediate_size, "ffn_down": hidden}  # fmt: skip
    inputs = {"attn_output": q_width, "ffn_down": c.intermediate_size}
    # phi3's files keep q/k/v and gate/up fused, as its checkpoints (Family.gguf_fused)
    fused = {"self_attn.qkv_proj": ("attn_qkv",), "mlp.gate_up_proj": ("ffn_up",)} if (
        FAMILIES[c.model_type].gguf_fused and "blk.0.attn_qkv.weight" in files.tensors) else FUSED
    widths = {**widths, "attn_qkv": q_width + 2 * kv_width,
              "ffn_up": (2 if fused is not FUSED else 1) * c.intermediate_size}
    for index, block in enumerate(net.layers):
        prefix = f"blk.{index}."
        norms = POST_NORM_TENSORS if c.post_norms else SANDWICH_TENSORS if c.sandwich_norms else LAYER_TENSORS
        for gguf_name, ours in norms.items():
            size = c.head_dim if "_q_norm" in gguf_name or "_k_norm" in gguf_name else hidden
            if c.qk_norm_full and "_q_norm" in gguf_name:  # over the whole projection (OLMo 2, OLMoE)
                size = q_width
            if c.qk_norm_full and "_k_norm" in gguf_name:
                size = kv_width
            if ours.startswith(("self_attn.q_norm", "self_attn.k_norm")) and not c.qk_norm:
                continue
            module = block.get_submodule(ours.rsplit(".", 1)[0])
            module.weight = files.float(prefix + gguf_name, (size,), norm_dtype)
        layers = {**fused, **{k: (v,) for k, v in SINGLE.items()}}
        if c.moe_layers[index]:
            _take_experts(files, block.mlp, prefix, c, dtype)
            layers = {k: v for k, v in layers.items() if not k.startswith("mlp.")}
        for ours, parts in layers.items():
            weights = [files.take(f"{prefix}{part}.weight", (widths[part], inputs.get(part, hidden)))
                       for part in parts]  # fmt: skip
            biases = [files.take(f"{prefix}{part}.bias", (widths[part],), required=False) for part in parts]
            block.set_submodule(ours, fused_layer(weights, biases, dtype))
    assert not any(t.is_meta for t in [*net.parameters(), *net.buffers()]), "a weight was not assigned"
    return net


def _take_experts(files: _Tensors, moe: nn.Module, prefix: str, c: NativeConfig, dtype: torch.dtype) -> None:
    """A layer's mixture of experts (models/feedforward.py `MoE`) from llama.cpp's tensors: the
    router ffn_gate_inp [E, hidden], the experts' ffn_gate_exps / ffn_up_exps [E, width, hidden]
    and ffn_down_exps [E, hidden, width], each expert keeping its file's grid; qwen2moe's shared
    expert ffn_{gate,up,down}_shexp and its gate ffn_gate_inp_shexp [1, hidden]."""
    hidden, width, count = c.hidden_size, c.expert_size, c.num_experts
    router = files.take(prefix + "ffn_gate_inp.weight", (count, hidden))
    moe.gate = linear_layer(float_weight([router], dtype), None, dtype)
    gates = files.experts(prefix + "ffn_gate_exps.weight", (count, width, hidden))
    ups = files.experts(prefix + "ffn_up_exps.weight", (count, width, hidden))
    downs = files.experts(prefix + "ffn_down_exps.weight", (count, hidden, width))
    for expert, gate, up, down in zip(moe.experts, gates, ups, downs, strict=True):
        expert.gate_up_proj = fused_layer([gate, up], [None, None], dtype)
        expert.down_proj = fused_layer([down], [None], dtype)
    if c.shared_expert_size:
        size = c.shared_expert_size
        shared = moe.shared_expert
        shared.gate_up_proj = fused_layer([files.take(prefix + "ffn_gate_shexp.weight", (size, hidden)),
                                           files.take(prefix + "ffn_up_shexp.weight", (size, hidden))],
                                          [None, None], dtype)  # fmt: skip
        down = files.take(prefix + "ffn_down_shexp.weight", (hidden, size))
        shared.down_proj = fused_layer([down], [None], dtype)
        name = prefix + "ffn_gate_inp_shexp.weight"  # [1, hidden], or [hidden] as llama-quantize leaves it
        flat = name in files.tensors and len(files.tensors[name].shape) == 1
        gate = files.take(name, (hidden,) if flat else (1, hidden))
        gate = gate.reshape(1, hidden) if flat else gate
        moe.shared_expert_gate = linear_layer(float_weight([gate], dtype), None, dtype)
