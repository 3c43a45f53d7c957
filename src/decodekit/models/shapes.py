"""Random-weight models with the layer shapes of real checkpoints (issue 15, item 4).

Speed is a property of shapes, not of trained values: a model with SmolLM2-135M's,
Qwen2.5-0.5B's or Llama-3.2-1B's layers costs what they cost per token, so the benchmarks
measure where users live without downloading weights. Each shape keeps its model's hidden
and intermediate sizes, heads, key/value heads, head size, layer count, RoPE (theta,
scaling), norm epsilon, biases and tied embeddings (the configs published with the
checkpoints on the Hugging Face hub), but its vocabulary is cut to the embedded
`shakespeare` tokenizer's 2,048 tokens so that prompts tokenise: the embedding and output
head are therefore smaller than the real ones (Qwen2.5-0.5B's 151,936 x 896 embedding is
136M parameters; here it is 1.8M), which makes the output head's share of a step smaller.

The weights are Gaussian, scaled so the logits are spread but not peaked: every projection
N(0, 1/fan_in), so each sublayer adds a residual of about its input's size, and the
embedding N(0, 9/hidden), so the tied output head gives logits of standard deviation ~3 from
a unit-RMS hidden state. The layers' sum then outweighs the input token's own embedding in
the last hidden state; with GPT-2's 1/sqrt(2 * layers) residual scaling it does not, and the
tied head puts ~0.99 of the probability on repeating the input token. (Gemma's embedding,
scaled by sqrt(hidden) on input, is drawn and read back to the same effect: `random_state_dict`.)
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from decodekit.models.checkpoint import TOKENIZER_FILES, load_tokenizer
from decodekit.models.families import FAMILIES
from decodekit.models.native import NativeLM
from decodekit.models.native_config import NativeConfig
from decodekit.models.registry import ASSETS, resolve_dtype

TOKENIZER_DIR = ASSETS / "shakespeare"  # the embedded BPE tokenizer: 2,048 tokens, EOS 0
VOCAB_SIZE = 2048

_SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
    "num_key_value_heads": 3, "num_hidden_layers": 30, "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "tie_word_embeddings": True,
}  # fmt: skip
_QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
    "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
    "num_key_value_heads": 2, "num_hidden_layers": 24, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": True,
}  # fmt: skip
_LLAMA32_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
    "num_key_value_heads": 8, "num_hidden_layers": 16, "head_dim": 64, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": True,
}  # fmt: skip
_GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
    "hidden_size": 1152, "intermediate_size": 6912, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "num_hidden_layers": 26, "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0, "sliding_window": 512, "sliding_window_pattern": 6,
    "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": True,
}  # fmt: skip

_QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
}  # fmt: skip

_LLAMA31_8B = {  # Llama-3.2-1B's family and RoPE, at 8B's widths and RoPE factor, untied
    **_LLAMA32_1B, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "head_dim": 128,
    "rope_scaling": {**_LLAMA32_1B["rope_scaling"], "factor": 8.0}, "tie_word_embeddings": False,
}  # fmt: skip

# Name -> the real model's config.json fields that set its shapes.
SHAPES: dict[str, dict] = {
    "smollm2-135m": _SMOLLM2_135M,
    "qwen2.5-0.5b": _QWEN25_05B,
    # Qwen2.5-0.5B's layers, 16 of its 24 (~240M parameters with the reduced vocabulary):
    # the model issue 15 measured against llama.cpp.
    "qwen2.5-0.5b-16l": {**_QWEN25_05B, "num_hidden_layers": 16},
    "llama-3.2-1b": _LLAMA32_1B,
    # Gemma 3 1B: five sliding layers (window 512) to one full, sandwich norms, GeGLU; its
    # 262,144-token vocabulary cut as the others' are
    "gemma-3-1b": _GEMMA3_1B,
    # Qwen3-30B-A3B's layers (a mixture of 128 experts, 8 a token), 2 of its 48: 1.26B
    # parameters, 0.07B of them read per token (a step costs about 1/24 of the whole's)
    "qwen3-30b-a3b-2l": {**_QWEN3_30B_A3B, "num_hidden_layers": 2},
    # Llama-3.1-8B's layers (hidden 4,096, MLP 14,336), 4 of its 32: 0.89B parameters, a step
    # costs about 1/8 of the whole's; the 7-8B class that most people run on a CPU
    "llama-3.1-8b-4l": {**_LLAMA31_8B, "num_hidden_layers": 4},
}


def shape_config(name: str, dtype: str | torch.dtype = "float32") -> dict:
    """The config.json of shape `name` (SHAPES), with the embedded tokenizer's vocabulary."""
    if name not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(repr(s) for s in SHAPES)}, got {name!r}")
    stored = str(resolve_dtype(dtype)).removeprefix("torch.")
    return {**SHAPES[name], "vocab_size": VOCAB_SIZE, "bos_token_id": 0, "eos_token_id": 0,
            "hidden_act": "silu", "torch_dtype": stored, "name_or_path": f"random-{name}"}  # fmt: skip


def random_state_dict(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Transformers-named float32 weights of `config`, Gaussian as the module docstring says."""
    generator = torch.Generator().manual_seed(seed)
    hidden, width = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads

    def gaussian(out_features: int, in_features: int, scale: float = 1.0) -> torch.Tensor:
        std = scale / math.sqrt(in_features)
        return torch.randn(out_features, in_features, generator=generator).mul_(std)

    family = FAMILIES[config["model_type"]]
    parsed = NativeConfig.from_dict(config)
    # A family that scales its embedding by sqrt(hidden) on input (Gemma) draws it sqrt(hidden)
    # smaller, so its layers see what the other shapes' do, and its final norm's gain of
    # sqrt(hidden) gives the tied head's logits the same spread.
    embed, gain = (3.0 / math.sqrt(hidden), math.sqrt(hidden)) if family.embed_scale else (3.0, 1.0)
    unit = 1.0 - family.norm_shift  # a norm's weight that scales by 1 (Gemma's: 0, for 1 + w)
    state = {"model.embed_tokens.weight": gaussian(config["vocab_size"], hidden, embed),
             "model.norm.weight": torch.full((hidden,), gain - family.norm_shift)}  # fmt: skip
    if not config["tie_word_embeddings"]:
        state["lm_head.weight"] = gaussian(config["vocab_size"], hidden, 3.0)
    qkv_bias = family.qkv_bias or config.get("attention_bias", False)
    norms = ["input_layernorm", "post_attention_layernorm"]
    norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if family.sandwich_norms else []
    if family.post_norms:  # OLMo 2: only the sublayers' outputs are normed
        norms = ["post_attention_layernorm", "post_feedforward_layernorm"]
    q_norm, k_norm = (heads * head_dim, kv_heads * head_dim) if family.qk_norm_full else (head_dim, head_dim)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for norm in norms:
            state[p + norm + ".weight"] = torch.full((hidden,), unit)
        if family.qk_norm:
            state[p + "self_attn.q_norm.weight"] = torch.full((q_norm,), unit)
            state[p + "self_attn.k_norm.weight"] = torch.full((k_norm,), unit)
        for part, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            state[p + f"self_attn.{part}_proj.weight"] = gaussian(rows * head_dim, hidden)
            if qkv_bias:
                state[p + f"self_attn.{part}_proj.bias"] = torch.zeros(rows * head_dim)
        state[p + "self_attn.o_proj.weight"] = gaussian(hidden, heads * head_dim)
        if parsed.moe_layers[i]:
            state.update(_random_experts(parsed, p, gaussian))
            continue
        state[p + "mlp.gate_proj.weight"] = gaussian(width, hidden)
        state[p + "mlp.up_proj.weight"] = gaussian(width, hidden)
        state[p + "mlp.down_proj.weight"] = gaussian(hidden, width)
    return state


def _random_experts(config: NativeConfig, prefix: str, gaussian) -> dict[str, torch.Tensor]:
    """One layer's mixture of experts under its checkpoint's names (Mixtral's or Qwen's): the
    router N(0, 1/hidden), so its scores spread over a few experts, and each expert an MLP."""
    hidden, width = config.hidden_size, config.expert_size
    mixtral = config.model_type == "mixtral"
    block = prefix + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    state = {block + "gate.weight": gaussian(config.num_experts, hidden)}
    mlps = [(f"experts.{e}.", width) for e in range(config.num_experts)]
    if config.shared_expert_size:
        mlps.append(("shared_expert.", config.shared_expert_size))
        state[block + "shared_expert_gate.weight"] = gaussian(1, hidden)
    for name, size in mlps:
        state[block + name + names[0] + ".weight"] = gaussian(size, hidden)
        state[block + name + names[1] + ".weight"] = gaussian(size, hidden)
        state[block + name + names[2] + ".weight"] = gaussian(hidden, size)
    return state


def random_model(
    name: str,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    seed: int = 0,
    layers: int | None = None,
) -> NativeLM:
    """A NativeLM of shape `name` with random weights and the embedded tokenizer; `layers`:
    only that many of its layers (the same widths: a step costs that fraction of the whole)."""
    config = shape_config(name, dtype)
    if layers is not None:
        if not 1 <= layers <= config["num_hidden_layers"]:
            raise ValueError(f"layers must be in [1, {config['num_hidden_layers']}], got {layers}")
        config["num_hidden_layers"] = layers
    tokenizer = load_tokenizer(TOKENIZER_DIR)
    state = random_state_dict(config, seed)
    model = NativeLM.from_state_dict(config, state, resolve_dtype(dtype), name=f"random-{name}",
                                     tokenizer=tokenizer, eos_token_ids=(0,))  # fmt: skip
    return model.to(device)


def save_random_checkpoint(
    name: str, path: str | Path, dtype: str | torch.dtype = "float32", seed: int = 0
) -> Path:
    """Write shape `name` with random weights as a Hugging Face checkpoint directory
    (config.json, model.safetensors, the embedded tokenizer): `load_model(path)` and
    transformers' `from_pretrained(path)` both read it. Returns the directory."""
    return save_checkpoint(shape_config(name, dtype), path, seed)


def save_checkpoint(config: dict, path: str | Path, seed: int = 0) -> Path:
    """Write random weights of a config.json dict (in its `torch_dtype`) with the embedded
    tokenizer to directory `path`; `save_random_checkpoint` of a shape's config."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch_dtype = resolve_dtype(config.get("torch_dtype", "float32"))
    state = {k: v.to(torch_dtype) for k, v in random_state_dict(config, seed).items()}
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for file in (*TOKENIZER_FILES, "generation_config.json"):
        if (TOKENIZER_DIR / file).exists():
            shutil.copy(TOKENIZER_DIR / file, path / file)
    return path
