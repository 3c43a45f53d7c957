"""Writing a Hugging Face checkpoint directory, or a directory `decodekit compress` wrote, as a
GGUF file (issue 27): what `decodekit compress ... --out FILE.gguf` runs, and what the GGUF
tests build their files with.

The layout is llama.cpp's converter's (convert_hf_to_gguf.py), so the file loads in llama.cpp
and in `load_model` (models/gguf_model.py): the metadata keys of gguf-py's `Keys`, tensor
names of its `TENSOR_NAMES`, q and k rows of llama-arch models reordered for ggml's RoPE
(the inverse of `gguf_tensors.unpermute_rope_rows`), and the tokenizer as a byte-level BPE
("gpt2") vocabulary. Matrices are stored as `tensor_type` (f32, f16, bf16, q8_0 or q4_0,
quantised by gguf-py's `gguf.quants.quantize`, which follows ggml's reference quantisers;
one whose input width is not a multiple of 32 is stored as f16, as llama.cpp falls back);
vectors (norms, biases) stay f32, as llama.cpp keeps them.

A compressed directory (models/compressed.py) keeps its own codes: a QuantizedLinear of 8 bits
in groups of 32 becomes q8_0 blocks, one of 4 bits in groups of 32 q4_0 blocks (codes c in
-8..7 stored as c + 8), each scale rounded to the blocks' float16 (a relative change of at
most 2^-11 per group: the one difference between the file and decodekit's model); its float
layers are stored as f32. Other grids raise ValueError naming the layer.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

TENSOR_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's, stored fused
    # a mixture of experts (models/feedforward.py): the router, each projection's experts stacked
    # [E, out, in] (`stacked_experts`), Qwen2-MoE's shared expert and its gate
    "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}  # fmt: skip
ROUTERS = ("ffn_gate_inp", "ffn_gate_inp_shexp")  # kept f32, as llama.cpp's converter and quantiser keep them
# A sandwich-norm block's (Gemma 3): ffn_norm is the MLP's input norm there
SANDWICH_NAMES = {
    **NAMES, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}  # fmt: skip
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(name: str, sandwich: bool = False) -> str:
    """GGUF's name of a transformers tensor name ("model.layers.3.mlp.up_proj.weight" ->
    "blk.3.ffn_up.weight"); `sandwich`: a sandwich-norm family's (Gemma 3)."""
    module, suffix = name.rsplit(".", 1)
    if module in TOP:
        return f"{TOP[module]}.{suffix}"
    parts = module.split(".")
    names = SANDWICH_NAMES if sandwich else NAMES
    if parts[:2] != ["model", "layers"] or ".".join(parts[3:]) not in names:
        raise ValueError(f"tensor {name!r} has no GGUF name (a Llama-family decoder has none like it)")
    return f"blk.{parts[2]}.{names['.'.join(parts[3:])]}.{suffix}"


def rope_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order for a llama-arch model (convert_hf_to_gguf.py
    `LlamaModel.permute`): per head, halves interleaved into adjacent pairs."""
    shape = rows.shape
    return rows.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def encode_tensor(values: np.ndarray, tensor_type: str) -> tuple[np.ndarray, Any]:
    """(data, gguf raw dtype or None) of a float32 tensor stored as `tensor_type`."""
    from gguf import GGMLQuantizationType, quants

    if values.ndim == 1 or tensor_type == "f32":
        return values.astype(np.float32), None
    if tensor_type == "f16" or (tensor_type in ("q8_0", "q4_0") and values.shape[-1] % 32):
        return values.astype(np.float16), None
    kind = GGMLQuantizationType[tensor_type.upper()]
    return quants.quantize(values.astype(np.float32), kind), kind


def pre_tokenizer_name(spec: dict[str, Any], model_dir: Path) -> str:
    """tokenizer.ggml.pre for a tokenizer.json: "gpt-2" for ByteLevel with GPT-2's split, else
    the name whose split regex (models/gguf_tokenizer.py `PRE_TOKENIZERS`) it splits by."""
    from decodekit.models.gguf_tokenizer import PRE_TOKENIZERS

    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    steps = pre.get("pretokenizers") or []
    if pre.get("type") == "Sequence" and steps and steps[0].get("type") == "Split":
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        for name, (known, _, _) in PRE_TOKENIZERS.items():
            if known is not None and known == pattern:
                return name
    raise ValueError(f"{model_dir}: tokenizer.json's pre-tokenizer is none GGUF names "
                     f"(known: ByteLevel with GPT-2's split, or the splits of {sorted(PRE_TOKENIZERS)})")


def tokenizer_metadata(writer: Any, model_dir: Path, config: dict[str, Any], arch: str) -> None:
    """The byte-level BPE vocabulary of tokenizer.json as tokenizer.ggml.* keys."""
    from gguf import TokenType

    spec = json.loads((model_dir / "tokenizer.json").read_text())
    if spec["model"]["type"] != "BPE":
        kind = spec["model"]["type"]
        raise ValueError(f"{model_dir}: GGUF writing takes a byte-level BPE tokenizer, got {kind}")
    vocab = dict(spec["model"]["vocab"])
    special = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    vocab.update({t["content"]: t["id"] for t in spec.get("added_tokens", [])})
    size = max(int(config["vocab_size"]), max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [TokenType.UNUSED] * size
    for token, index in vocab.items():
        tokens[index] = token
        types[index] = TokenType.CONTROL if token in special else TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(spec, model_dir))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    tokenizer_config = model_dir / "tokenizer_config.json"
    extra = json.loads(tokenizer_config.read_text()) if tokenizer_config.exists() else {}
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("pad", writer.add_pad_token_id)):  # fmt: skip
        token = extra.get(f"{key}_token")
        token = token.get("content") if isinstance(token, dict) else token
        index = vocab.get(token) if token is not None else config.get(f"{key}_token_id")
        if isinstance(index, int):
            add(index)
    # A template processor that puts a token before "$A" adds BOS (llama.cpp's add_bos_token).
    single = (spec.get("post_processor") or {}).get("single") or []
    writer.add_add_bos_token(bool(single) and "SpecialToken" in single[0])
    if extra.get("chat_template"):
        writer.add_chat_template(extra["chat_template"])


def code_blocks(codes: Any, scales: Any, bits: int, where: str) -> tuple[np.ndarray, Any]:
    """(uint8 [N, bytes], gguf type) of a QuantizedLinear's codes int8 [N, K] and scales [N, K/32]
    as q8_0 or q4_0 blocks (ggml-common.h `block_q8_0`, `block_q4_0`; module docstring)."""
    from gguf import GGMLQuantizationType

    n, k = codes.shape
    if scales.shape[1] * 32 != k or bits not in (4, 8):
        raise ValueError(f"{where}: GGUF takes 8- or 4-bit codes in groups of 32 (q8_0, q4_0), got "
                         f"{bits} bits with {k // scales.shape[1]} inputs per scale")  # fmt: skip
    d = scales.float().numpy().astype(np.float16).view(np.uint8).reshape(n, -1, 2)  # [N, G, 2]
    c = codes.numpy().astype(np.int16).reshape(n, -1, 32)  # [N, G, 32]
    if bits == 8:
        quants, kind = c.astype(np.int8).view(np.uint8), GGMLQuantizationType.Q8_0
    else:
        q = (c + 8).astype(np.uint8)
        quants, kind = q[..., :16] | (q[..., 16:] << 4), GGMLQuantizationType.Q4_0
    return np.concatenate([d, quants], axis=-1).reshape(n, -1), kind


FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def stacked_experts(state: dict[str, Any], config: Any) -> dict[str, Any]:
    """`state` with each layer's experts' projections stacked into one [E, out, in] entry
    ("model.layers.3.mlp.experts.gate_proj.weight", llama.cpp's ffn_gate_exps): float tensors
    stacked, a compressed directory's (codes, scales, bits) kept as a list of them, one an expert.
    Mixtral's names (block_sparse_moe, w1/w2/w3) are read as Qwen's."""
    from decodekit.models.native import mixtral_to_qwen

    state = {mixtral_to_qwen(name): value for name, value in state.items()}
    for layer, has_experts in enumerate(config.moe_layers):
        if not has_experts:
            continue
        for part in ("gate_proj", "up_proj", "down_proj"):
            names = [f"model.layers.{layer}.mlp.experts.{e}.{part}.weight" for e in range(config.num_experts)]
            values = [state.pop(name) for name in names]
            stacked = values if isinstance(values[0], tuple) else torch.stack(values)
            state[f"model.layers.{layer}.mlp.experts.{part}.weight"] = stacked
    return state


def compressed_tensors(model_dir: Path, config: Any) -> dict[str, Any]:
    """Transformers-named tensors of a compressed directory (`config`: its NativeConfig): float
    tensors, and (codes, scales, bits) for each part of a QuantizedLinear, the fused q/k/v and
    gate/up split back into their parts."""
    from decodekit.models.compressed import load_compressed_dir
    from decodekit.models.qlinear import QuantizedLinear

    net = load_compressed_dir(model_dir).net
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    state: dict[str, Any] = {}
    for name, module in net.named_modules():
        tied = name == "lm_head" and config.tie_word_embeddings
        if tied or not isinstance(module, QuantizedLinear | torch.nn.Linear):
            continue
        parent, _, leaf = name.rpartition(".")
        prefix = f"model.{parent}." if parent else ""
        half = module.out_features // 2  # gate/up: an MLP's, an expert's or a shared expert's
        widths = {"qkv_proj": [q, kv, kv], "gate_up_proj": [half, half]}.get(leaf, [module.out_features])
        if isinstance(module, QuantizedLinear):
            codes, scales = module.codes().split(widths), module.scales.split(widths)
            values = [(c, sc, module.spec.bits) for c, sc in zip(codes, scales, strict=True)]
        else:
            values = list(module.weight.detach().split(widths))
        biases = [None] * len(widths) if module.bias is None else list(module.bias.detach().split(widths))
        for part, value, bias in zip(FUSED_PARTS.get(leaf, (leaf,)), values, biases, strict=True):
            state[f"{prefix}{part}.weight"] = value
            if bias is not None:
                state[f"{prefix}{part}.bias"] = bias
    for name, parameter in net.named_parameters():
        if name.endswith("norm.weight") or name == "embed_tokens.weight":
            state[f"model.{name}"] = parameter.detach()
    return state


def write_gguf(model_dir: str | Path, out: str | Path, tensor_type: str = "f32") -> Path:
    """Write the checkpoint in `model_dir` (config.json, safetensors, tokenizer.json; or a
    compressed directory) as the GGUF file `out` with float matrices stored as `tensor_type`
    (module docstring)."""
    from decodekit.models.checkpoint import load_safetensors, read_config
    from decodekit.models.compressed import COMPRESSION_FILE
    from decodekit.models.families import FAMILIES
    from decodekit.models.native_config import NativeConfig
    from decodekit.optional import require

    gguf = require("gguf", "gguf", "writing GGUF files")
    if tensor_type not in TENSOR_TYPES:
        raise ValueError(f"tensor_type must be one of {', '.join(TENSOR_TYPES)}, got {tensor_type!r}")
    model_dir, out = Path(model_dir), Path(out)
    config = read_config(model_dir)
    parsed = NativeConfig.from_dict(config)  # the architectures NativeLM runs, and no others
    family = FAMILIES[parsed.model_type]
    arch = family.gguf
    compressed = (model_dir / COMPRESSION_FILE).exists()
    if family.gguf_fused and compressed:  # its layers' codes would have to be joined back
        raise ValueError(f"{model_dir}: GGUF writing takes a {parsed.model_type} checkpoint, not a "
                         "compressed directory of one")  # fmt: skip
    if parsed.rope.head_dim != parsed.head_dim and not family.gguf_fused:
        raise ValueError(f"{model_dir}: GGUF's {arch} rotates whole heads; this model rotates "
                         f"{parsed.rope.head_dim} of {parsed.head_dim} dims")  # fmt: skip
    state = compressed_tensors(model_dir, parsed) if compressed else load_safetensors(model_dir)
    if compressed:
        tensor_type = "f32"  # the float layers; the quantised ones keep their codes
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(model_dir.name)
    writer.add_context_length(parsed.max_positions)
    writer.add_embedding_length(parsed.hidden_size)
    # (Mixtral's experts' width is its feed_forward_length; Qwen-MoE's MLP width)
    writer.add_feed_forward_length(parsed.intermediate_size)
    writer.add_block_count(parsed.num_layers)
    writer.add_head_count(parsed.num_heads)
    writer.add_head_count_kv(parsed.num_kv_heads)
    writer.add_key_length(parsed.head_dim)
    writer.add_value_length(parsed.head_dim)
    writer.add_rope_dimension_count(parsed.rope.head_dim)  # phi3: its rotated dims
    writer.add_rope_freq_base(parsed.rope.theta)
    writer.add_layer_norm_rms_eps(parsed.rms_norm_eps)
    writer.add_vocab_size(parsed.vocab_size)
    if parsed.rope.kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(parsed.rope.factor)
    elif parsed.rope.kind == "llama3":  # as llama.cpp's converter: per-frequency divisors
        from dataclasses import replace

        from decodekit.models.rope import inverse_frequencies

        plain = inverse_frequencies(replace(parsed.rope, kind="default"), 0)
        factors = (plain / inverse_frequencies(parsed.rope, 0)).numpy().astype(np.float32)
        writer.add_tensor("rope_freqs.weight", factors)
    elif parsed.rope.kind == "longrope" and family.gguf_fused:  # as llama.cpp's phi3 converter
        writer.add_rope_scaling_orig_ctx_len(parsed.rope.original_max_positions)
        writer.add_rope_scaling_attn_factors(parsed.rope.attention_factor)
        writer.add_tensor("rope_factors_long.weight", np.array(parsed.rope.long_factor, dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(parsed.rope.short_factor, dtype=np.float32))
    elif parsed.rope.kind != "default":
        raise ValueError(f"{model_dir}: GGUF writing takes default, linear or llama3 RoPE (and phi3's "
                         f"longrope), got {parsed.rope.kind!r}")
    if family.qk_norm_full and arch == "olmoe" and parsed.num_kv_heads != parsed.num_heads:
        # llama.cpp's olmoe reads attn_k_norm as wide as the model (OLMoE-1B-7B has no GQA)
        raise ValueError(f"{model_dir}: llama.cpp's olmoe takes num_key_value_heads equal to "
                         f"num_attention_heads ({parsed.num_heads}), got {parsed.num_kv_heads}")
    if parsed.num_experts:
        experts_metadata(writer, parsed, arch, model_dir)
        state = stacked_experts(state, parsed)
    if arch in ("gemma2", "gemma3"):
        gemma_metadata(writer, parsed, arch, model_dir)
    elif any(window is not None and window < parsed.context_length for window in parsed.layer_windows):
        # (a window as long as the context slides nothing: Phi-3.5's 262,144)
        raise ValueError(f"{model_dir}: GGUF writing does not take sliding-window attention")
    elif parsed.query_scale is not None or parsed.final_softcap is not None:  # Gemma 1's graph has neither
        raise ValueError(f"{model_dir}: GGUF's {arch} takes neither query_pre_attn_scalar nor "
                         "final_logit_softcapping")  # fmt: skip
    # Gemma's norms (1 + w) are stored shifted, as llama.cpp's converter stores them; a compressed
    # directory's already are (LlamaNet's own weights)
    shift = 0.0 if compressed else family.norm_shift
    writer.add_file_type({"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "bf16": 32}[tensor_type])
    tokenizer_metadata(writer, model_dir, config, arch)
    heads = {"q_proj": parsed.num_heads, "k_proj": parsed.num_kv_heads}
    for name, tensor in state.items():
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and parsed.tie_word_embeddings):
            continue
        projection = name.split(".")[-2]
        # (a post-norm block's norms take the sandwich's names: post_attention_norm, post_ffw_norm)
        target = gguf_name(name, family.sandwich_norms or family.post_norms)
        if isinstance(tensor, tuple):
            data, raw_dtype = code_blocks(*tensor, where=f"{model_dir}: {name}")
        elif isinstance(tensor, list):  # a compressed directory's experts, one (codes, scales, bits) each
            blocks = [code_blocks(*expert, where=f"{model_dir}: {name}") for expert in tensor]
            data, raw_dtype = np.stack([data for data, _ in blocks]), blocks[0][1]
        else:
            values = tensor.float() + shift if shift and name.endswith("norm.weight") else tensor.float()
            stored = "f32" if target.rsplit(".", 2)[-2] in ROUTERS else tensor_type
            data, raw_dtype = encode_tensor(values.numpy(), stored)
        if family.rope_permuted and projection in heads:
            data = rope_permute(data, heads[projection])  # whole rows, so blocks move intact
        writer.add_tensor(target, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def experts_metadata(writer: Any, parsed: Any, arch: str, model_dir: Path) -> None:
    """A mixture of experts' keys (models/gguf_model.py `experts_config` reads them back). llama.cpp's
    graph renormalises the chosen experts' weights or not by architecture and gives every layer
    experts, so a model that differs is refused."""
    from decodekit.models.gguf_model import NORMALISED_EXPERTS

    if parsed.normalize_expert_weights != NORMALISED_EXPERTS[arch]:
        raise ValueError(f"{model_dir}: llama.cpp's {arch} takes norm_topk_prob {NORMALISED_EXPERTS[arch]}, "
                         f"this model {parsed.normalize_expert_weights}")  # fmt: skip
    if not all(parsed.moe_layers):
        dense = [i for i, experts in enumerate(parsed.moe_layers) if not experts]
        raise ValueError(f"{model_dir}: llama.cpp's {arch} gives every layer experts; layers {dense} "
                         "have an MLP")
    writer.add_expert_count(parsed.num_experts)
    writer.add_expert_used_count(parsed.experts_per_token)
    if arch not in ("llama", "olmoe"):  # Mixtral's and OLMoE's experts are feed_forward_length wide
        writer.add_expert_feed_forward_length(parsed.expert_size)
    if parsed.shared_expert_size:
        writer.add_expert_shared_feed_forward_length(parsed.shared_expert_size)


def gemma_metadata(writer: Any, parsed: Any, arch: str, model_dir: Path) -> None:
    """A Gemma 2's or 3's keys beyond Llama's, as llama.cpp's graph reads them
    (models/gguf_model.py `gemma_config`): the window and one sliding flag a layer, the sliding
    layers' RoPE base (gemma3), the scores' cap (gemma2) and the logits' cap. The queries'
    scale is not a key: llama.cpp derives it from the shapes, so a model whose
    query_pre_attn_scalar differs from that rule is refused, as is a gemma2 without both caps
    (its graph always applies them)."""
    from decodekit.models.gguf_model import GEMMA_GRAPHS

    graph = GEMMA_GRAPHS[arch]
    windows = parsed.layer_windows
    if windows:
        if len({w for w in windows if w is not None}) > 1:
            sizes = sorted(set(windows) - {None})
            raise ValueError(f"{model_dir}: GGUF's {arch} takes one sliding window, got {sizes}")
        writer.add_sliding_window(next(w for w in windows if w is not None))
        writer.add_sliding_window_pattern([w is not None for w in windows])
    elif graph.window:
        raise ValueError(f"{model_dir}: llama.cpp's {arch} slides its layers; this model has no "
                         "sliding_window")
    if parsed.local_rope is not None:
        if parsed.local_rope.kind != "default":
            raise ValueError(f"{model_dir}: GGUF's {arch} takes default RoPE on its sliding layers, "
                             f"got {parsed.local_rope.kind!r}")  # fmt: skip
        writer.add_rope_freq_base_swa(parsed.local_rope.theta)
    if graph.attn_softcap is not None:
        if parsed.attn_softcap is None or parsed.final_softcap is None:
            raise ValueError(f"{model_dir}: llama.cpp's {arch} caps attention scores and logits; this model "
                             "lacks attn_logit_softcapping or final_logit_softcapping")  # fmt: skip
        writer.add_attn_logit_softcapping(parsed.attn_softcap)
    elif parsed.attn_softcap is not None:
        raise ValueError(f"{model_dir}: GGUF's {arch} takes no attn_logit_softcapping")
    if parsed.final_softcap is not None:
        writer.add_final_logit_softcapping(parsed.final_softcap)
    wide = parsed.num_layers == graph.wide_layers
    scalar = parsed.hidden_size // parsed.num_heads if wide else parsed.head_dim
    if abs((parsed.query_scale or 1.0) - (parsed.head_dim / scalar) ** 0.5) > 1e-6:
        raise ValueError(f"{model_dir}: llama.cpp's {arch} scales queries by 1 / sqrt({scalar}); this "
                         "model's query_pre_attn_scalar differs")  # fmt: skip


def compress_to_gguf(model: str | Path, config: Any, out: str | Path, calib_file: str | Path | None = None,
                     progress: bool = False) -> dict[str, Any]:  # fmt: skip
    """`decodekit compress MODEL ... --out FILE.gguf`: compress as `recipe.compress_to_dir`
    does (`config`: a CompressConfig), then write the result as GGUF (module docstring). A
    quantising method needs 8 or 4 bits in groups of 32 (q8_0, q4_0); a layer whose width 32
    does not divide stays float (f32 in the file), as compress leaves it. Returns its report,
    `out` and `disk_bytes` the file's."""
    import tempfile

    from decodekit.compress.apply import QUANT_METHODS
    from decodekit.compress.recipe import compress_to_dir

    if config.method in QUANT_METHODS:
        bits = config.bits or (8 if config.method == "rtn" else 4)
        if bits not in (4, 8) or config.group_size != 32:
            raise ValueError(f"GGUF stores 8- or 4-bit codes in groups of 32 (q8_0, q4_0): give bits 8 or 4 "
                             f"and group 32, got bits {bits} and group {config.group_size}")  # fmt: skip
    if config.head_bits not in (None, "auto"):
        # its head is one scale per channel, which no GGUF block type stores
        raise ValueError(f"head_bits applies to a directory out, not a GGUF file, got {config.head_bits}")
    config = dataclasses.replace(config, head_bits=None)  # "auto": the head as the writer stores it
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="decodekit-compress-") as folder:
        report = compress_to_dir(model, config, Path(folder) / "model", calib_file, progress)
        write_gguf(Path(folder) / "model", out)
    return {**report, "out": str(out), "disk_bytes": out.stat().st_size, "format": "gguf"}
