"""The configuration `NativeLM` reads from a checkpoint's config.json (models/native.py):
which families and settings its forward runs (`unsupported_reason`), the fields it uses
(`NativeConfig`), each layer's sliding window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from decodekit.models.families import FAMILIES, Family
from decodekit.models.rope import ROPE_TYPES, RopeConfig, rope_config, rotary_size
from decodekit.models.rope import rope_parameters as read_rope_parameters

# The MLP gate's activations (transformers' ACT2FN names): SwiGLU's, and GeGLU's two GELUs
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")


def activation(config: dict[str, Any]) -> str:
    """The MLP gate's activation of a config.json of a known family."""
    family = FAMILIES[config["model_type"]]
    name = config.get(family.activation_key) or "silu"
    if config["model_type"] == "gemma" and name == "gelu":
        # transformers' GemmaConfig reads Gemma 1's legacy "gelu" as the tanh approximation
        return "gelu_pytorch_tanh"
    return name


def unsupported_reason(config: dict[str, Any]) -> str | None:
    """Why NativeLM cannot run this config.json, or None if it can."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        return f"model_type must be one of {sorted(FAMILIES)}, got {model_type!r}"
    classes = sorted({family.architecture for family in FAMILIES.values()})
    unknown = [a for a in config.get("architectures") or [] if a not in classes]
    if unknown:
        return f"architectures must be among {classes}, got {unknown}"
    family = FAMILIES[model_type]
    if activation(config) not in ACTIVATIONS:
        return f"{family.activation_key} must be one of {ACTIVATIONS}, got {activation(config)!r}"
    if config.get("use_bidirectional_attention"):
        return "use_bidirectional_attention must be false: NativeLM's attention is causal"
    layer_types = ("full_attention", "sliding_attention") if family.local_rope else (None,)
    for layer_type in layer_types:
        rope = read_rope_parameters(config, layer_type)
        if rope["rope_type"] not in ROPE_TYPES:
            return f"rope_type must be one of {ROPE_TYPES}, got {rope['rope_type']!r}"
        if family.local_rope and rope["rope_type"] in ("dynamic", "longrope"):
            return f"rope_type must not be {rope['rope_type']!r} where layers have their own RoPE"
        if rope["rope_type"] == "longrope" and not (rope.get("short_factor") and rope.get("long_factor")):
            return "a longrope rope_type needs short_factor and long_factor"
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        rotated = rotary_size(config, head_dim, layer_type)
        if rotated <= 0 or rotated % 2 or rotated > head_dim:
            return (f"partial_rotary_factor must rotate an even number of a head's {head_dim} dims, "
                    f"got {rotated}")
    if config.get("clip_qkv") is not None:
        return f"clip_qkv must be null (OLMoE's q/k/v clamp is not run), got {config['clip_qkv']!r}"
    if config.get("quantization_config"):
        return "pre-quantised checkpoints (quantization_config) are not supported"
    return None


@dataclass(frozen=True)
class NativeConfig:
    """The fields of a config.json that the forward uses."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_positions: int
    rope: RopeConfig
    qkv_bias: bool = False
    output_bias: bool = False  # o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3, Gemma 3
    qk_norm_full: bool = False  # the q/k norms span the whole projection, not a head (OLMo 2, OLMoE)
    post_norms: bool = False  # each sublayer's output normed, no input norms (OLMo 2)
    tie_word_embeddings: bool = False
    # Each layer's sliding window (None: full attention); () when no layer slides.
    layer_windows: tuple[int | None, ...] = ()
    activation: str = "silu"  # the MLP gate's (ACTIVATIONS)
    # Gemma's differences (models/families.py): the RMSNorm weights' shift (folded into the
    # weights at load), the embedding's scale (None: 1), four norms a block
    norm_shift: float = 0.0
    embed_scale: float | None = None
    sandwich_norms: bool = False
    # the sliding layers' own RoPE (Gemma 3); None: every layer rotates by `rope`
    local_rope: RopeConfig | None = None
    # the queries' multiplier before attention's head_dim ** -0.5, which makes the scores'
    # scale query_pre_attn_scalar ** -0.5 (Gemma 3); None: 1
    query_scale: float | None = None
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2/3)
    attn_softcap: float | None = None  # each attention score so capped (Gemma 2)
    # A mixture of experts in place of the MLP (Mixtral, Qwen2/3-MoE; models/feedforward.py):
    # how many experts, how many each token runs, each one's width, whether the chosen
    # experts' weights are renormalised to sum to 1, Qwen2-MoE's shared expert's width (0:
    # none), and which layers have experts (() when none does)
    num_experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0
    normalize_expert_weights: bool = True
    shared_expert_size: int = 0
    expert_layers: tuple[bool, ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(
                f"layer_windows must have one entry per layer ({self.num_layers}), "
                f"got {len(self.layer_windows)}"
            )
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {self.num_experts}], "
                             f"got {self.experts_per_token}")
        if self.expert_layers and len(self.expert_layers) != self.num_layers:
            raise ValueError(f"expert_layers must have one entry per layer ({self.num_layers}), "
                             f"got {len(self.expert_layers)}")
        bad = [w for w in self.layer_windows if w is not None and w < 1]
        if bad:
            raise ValueError(f"sliding_window must be >= 1, got {bad[0]}")

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Whether each layer's MLP is a mixture of experts."""
        return self.expert_layers or (False,) * self.num_layers

    @property
    def context_length(self) -> int:
        """Positions the model can encode: max_position_embeddings, stretched by linear or
        dynamic RoPE scaling (for these, transformers' docs say not to raise
        max_position_embeddings to the new length; llama3 configs already state it)."""
        if self.rope.kind in ("linear", "dynamic") and self.local_rope is None:
            # (Gemma 3's max_position_embeddings is the stretched context already)
            return int(self.max_positions * max(self.rope.factor, 1.0))
        return self.max_positions

    @classmethod
    def from_dict(cls, config: dict[str, Any], tie_default: bool = False) -> NativeConfig:
        """Parse a config.json dict; `tie_default` applies when it has no tie_word_embeddings."""
        reason = unsupported_reason(config)
        if reason is not None:
            raise ValueError(f"NativeLM cannot load this model: {reason}")
        model_type = config["model_type"]
        family = FAMILIES[model_type]
        heads = int(config["num_attention_heads"])
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        # Which projections carry a bias differs by family (transformers modeling_*.py).
        attention_bias = bool(config.get("attention_bias", False))
        qkv_bias = attention_bias if family.qkv_bias is None else family.qkv_bias
        output_bias = attention_bias and family.output_bias
        windows = _layer_windows(config, int(config["num_hidden_layers"]))
        local_rope = None
        if family.local_rope and any(w is not None for w in windows):
            local_rope = rope_config(config, int(head_dim), "sliding_attention")
        query_scale = None
        if config.get("query_pre_attn_scalar") is not None:
            query_scale = (int(head_dim) / float(config["query_pre_attn_scalar"])) ** 0.5
            query_scale = None if query_scale == 1.0 else query_scale
        softcap = config.get("final_logit_softcapping")
        attn_softcap = config.get("attn_logit_softcapping")
        return cls(
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_positions=int(config.get("max_position_embeddings", 2048)),
            rope=rope_config(config, int(head_dim), "full_attention" if family.local_rope else None),
            qkv_bias=qkv_bias,
            output_bias=output_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=family.qk_norm,
            qk_norm_full=family.qk_norm_full,
            post_norms=family.post_norms,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", tie_default)),
            layer_windows=windows,
            activation=activation(config),
            norm_shift=family.norm_shift,
            embed_scale=float(config["hidden_size"]) ** 0.5 if family.embed_scale else None,
            sandwich_norms=family.sandwich_norms,
            local_rope=local_rope,
            query_scale=query_scale,
            final_softcap=None if softcap is None else float(softcap),
            attn_softcap=None if attn_softcap is None else float(attn_softcap),
            **_experts(config, family),
        )


def _experts(config: dict[str, Any], family: Family) -> dict[str, Any]:
    """NativeConfig's mixture-of-experts fields, as transformers' modeling_{mixtral,qwen2_moe,
    qwen3_moe}.py read them: a Qwen layer has experts unless it is in mlp_only_layers, every
    decoder_sparse_step-th layer; Mixtral's every layer, its experts intermediate_size wide."""
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if not family.experts or not experts:
        return {}
    layers = int(config["num_hidden_layers"])
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or ())
    return dict(
        num_experts=experts,
        experts_per_token=int(config.get("num_experts_per_tok", 2)),
        expert_size=int(config.get("moe_intermediate_size") or config["intermediate_size"]),
        normalize_expert_weights=bool(config.get("norm_topk_prob", family.normalize_experts)),
        shared_expert_size=int(config.get("shared_expert_intermediate_size") or 0),
        expert_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
    )


def _layer_windows(config: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window, as transformers' modeling_{mistral,qwen2,qwen3,gemma3}.py."""
    window = config.get("sliding_window")
    sliding = FAMILIES[config["model_type"]].sliding
    if window is None or sliding == "never":
        return ()
    layer_types = config.get("layer_types")
    if layer_types is None and sliding == "use_sliding_window":
        if not config.get("use_sliding_window", False):
            return ()
        first = int(config.get("max_window_layers", 28))
        layer_types = ["sliding_attention" if i >= first else "full_attention"
                       for i in range(num_layers)]  # fmt: skip
    if layer_types is None and sliding == "pattern":  # transformers' Gemma3TextConfig
        pattern = int(config.get("sliding_window_pattern", FAMILIES[config["model_type"]].sliding_pattern))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                       for i in range(num_layers)]  # fmt: skip
    if layer_types is None:
        return (int(window),) * num_layers  # sliding "every" (Mistral)
    if "sliding_attention" not in layer_types:
        return ()
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
