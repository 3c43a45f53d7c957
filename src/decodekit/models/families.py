"""The Llama-like families NativeLM runs, in one table: what sets each apart.

`FAMILIES` maps a config.json `model_type` to its `Family`; NativeLM's config parsing
(native.py), the GGUF reader (gguf_model.py), the GGUF writer (compress/gguf.py), the reward
models' body (meta/reward_engine.py) and the random checkpoints (shapes.py) read it, and
nothing else names a family. A new Llama-like family (or an alias of one) is one entry here
and a parity test against transformers' logits (docs/ARCHITECTURE.md, "A model family").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Family:
    """One family's differences (transformers' modeling_{model_type}.py; llama.cpp's
    convert_hf_to_gguf.py for `gguf` and `rope_permuted`)."""

    architecture: str  # config.json "architectures": transformers' class of the family
    gguf: str  # GGUF general.architecture llama.cpp's converter writes (a family's model_type)
    # q/k/v biases: True always (Qwen2), False never, None as config.json's attention_bias says
    qkv_bias: bool | None = None
    output_bias: bool = True  # o_proj's bias follows attention_bias (False: never)
    qk_norm: bool = False  # per-head RMSNorm of q and k (Qwen3)
    # Which layers slide when config.json has a sliding_window and no layer_types: "never"
    # (Llama ignores it), "every" layer (Mistral), as use_sliding_window and
    # max_window_layers say (Qwen2/3, "use_sliding_window"), or all but every
    # sliding_window_pattern-th layer (Gemma 2 and 3, "pattern", `sliding_pattern` by default).
    sliding: Literal["never", "every", "use_sliding_window", "pattern"] = "never"
    # q and k rows reordered for ggml's RoPE in GGUF files of this family (llama-arch)
    rope_permuted: bool = False
    # Gemma's differences (transformers' modeling_gemma.py, modeling_gemma3.py):
    # RMSNorm scales by (1 + weight): LlamaNet stores the weight plus `norm_shift`, as llama.cpp's
    # converter does, so its norms stay Llama's
    norm_shift: float = 0.0
    embed_scale: bool = False  # the embedding times sqrt(hidden_size), rounded to the model's dtype
    # the config.json key of the MLP's gate activation (Gemma 3: hidden_activation)
    activation_key: str = "hidden_act"
    # four norms a block: the attention's and the MLP's outputs are normed before their
    # residual add (Gemma 2/3: post_attention_layernorm, pre_ and post_feedforward_layernorm)
    sandwich_norms: bool = False
    # sliding layers rotate with their own RoPE base (Gemma 3: rope_parameters per layer type)
    local_rope: bool = False
    # llama.cpp stores q/k/v as one attn_qkv and gate/up as one ffn_up for this architecture
    # (Phi-3), as its checkpoints do; a compressed directory of it is not written as GGUF
    gguf_fused: bool = False
    sliding_pattern: int = 6  # "pattern"'s default n (every n-th layer full)
    # a mixture of experts in place of the MLP (models/feedforward.py), and whether the chosen
    # experts' weights are renormalised when config.json has no norm_topk_prob (Mixtral: always)
    experts: bool = False
    normalize_experts: bool = False
    # q and k RMSNorm over the whole projection, before it is split into heads (OLMo 2, OLMoE)
    qk_norm_full: bool = False
    # no input norms: each sublayer's output is normed before its residual add (OLMo 2)
    post_norms: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", "llama", rope_permuted=True),
    "mistral": Family("MistralForCausalLM", "llama", output_bias=False, sliding="every", rope_permuted=True),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", qkv_bias=True, output_bias=False,
                    sliding="use_sliding_window"),
    "qwen3": Family("Qwen3ForCausalLM", "qwen3", qk_norm=True, sliding="use_sliding_window"),
    # checkpoints store qkv_proj and gate_up_proj fused, as LlamaNet holds them
    "phi3": Family("Phi3ForCausalLM", "phi3", qkv_bias=False, output_bias=False, sliding="every",
                   gguf_fused=True),
    "gemma": Family("GemmaForCausalLM", "gemma", norm_shift=1.0, embed_scale=True),
    # its attention caps its scores (attn_logit_softcapping: models/attention.py); every other
    # layer slides
    "gemma2": Family("Gemma2ForCausalLM", "gemma2", norm_shift=1.0, embed_scale=True, sliding="pattern",
                     sliding_pattern=2, activation_key="hidden_activation", sandwich_norms=True),
    "gemma3_text": Family("Gemma3ForCausalLM", "gemma3", qk_norm=True, sliding="pattern", norm_shift=1.0,
                          embed_scale=True, activation_key="hidden_activation", sandwich_norms=True,
                          local_rope=True),
    # mixtures of experts (models/feedforward.py); llama.cpp writes Mixtral as llama with experts
    "mixtral": Family("MixtralForCausalLM", "llama", output_bias=False, sliding="every", rope_permuted=True,
                      experts=True, normalize_experts=True),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", "qwen2moe", qkv_bias=True, output_bias=False,
                        sliding="use_sliding_window", experts=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", "qwen3moe", qk_norm=True, sliding="use_sliding_window",
                        experts=True),
    # AI2's fully open models: OLMo 2 (post-norm blocks) and OLMoE (a mixture of experts)
    "olmo2": Family("Olmo2ForCausalLM", "olmo2", qk_norm=True, qk_norm_full=True, post_norms=True),
    "olmoe": Family("OlmoeForCausalLM", "olmoe", qk_norm=True, qk_norm_full=True, experts=True),
}


# GGUF architecture -> the model_type it is read as: a family's own name (llama.cpp writes
# Mistral and SmolLM as llama), and "gemma3" for Gemma 3's text model.
GGUF_MODEL_TYPES = {
    family.gguf: name for name, family in FAMILIES.items()
    if family.gguf == name or family.gguf not in FAMILIES
}  # fmt: skip
