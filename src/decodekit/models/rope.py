"""Rotary position embeddings (RoPE) with the scalings the Llama family uses.

RoPE (Su et al. 2021, "RoFormer") rotates each pair (x_i, x_{i+D/2}) of a query or key by
the angle position * inv_freq_i. Scalings change only `inv_freq`:
- default:  inv_freq_i = theta^(-2i/D)
- linear:   inv_freq / factor (position interpolation, Chen et al. 2023)
- dynamic:  NTK-aware, theta is raised once positions exceed max_position_embeddings
            (bloc97/emozilla; transformers `_compute_dynamic_ntk_parameters`). The length
            is each row's own (`RotaryTables.at`): a token's frequencies are those of its
            sequence's length in this forward, so a row decodes the same alone or batched.
            (transformers shares one length, the batch's longest position, between rows:
            its batched and alone outputs differ once a row passes the threshold; alone,
            the two conventions agree.)
- llama3:   low frequencies / factor, high frequencies kept, a smooth ramp between
            (Llama 3.1; transformers `_compute_llama3_parameters`)
- longrope: inv_freq_i / f_i with per-frequency factors, `short_factor` for a sequence within
            original_max_position_embeddings and `long_factor` past it, and cos/sin scaled by
            an attention factor (Phi-3.5, Phi-4-mini; transformers `_compute_longrope_parameters`).
            Like dynamic NTK the length is each row's own (`RopeConfig.threshold`).
Partial rotary (partial_rotary_factor < 1: Phi-4-mini): the tables cover the first
`head_dim` = factor x the head's size of each head; the rest passes unrotated (native.py).
- frequency_factors: inv_freq_i / f_i for given per-frequency divisors (any kind): how GGUF
            files store Llama 3's scaling (tensor rope_freqs.weight; llama.cpp's rope divides
            theta_i by it), models/gguf_model.py
cos/sin tables are computed once in float32 exactly as transformers does, then sliced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    head_dim: int
    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 2048
    max_positions: int = 2048  # the model's max_position_embeddings (dynamic NTK threshold)
    frequency_factors: tuple[float, ...] = ()  # per-frequency divisors of inv_freq (module docstring)
    short_factor: tuple[float, ...] = ()  # longrope's divisors within original_max_positions
    long_factor: tuple[float, ...] = ()  # and past them
    attention_factor: float = 1.0  # longrope: cos and sin scaled by it

    def __post_init__(self):
        if self.kind not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {self.kind!r}")
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even number, got {self.head_dim}")
        if self.kind != "default" and self.factor <= 0:
            raise ValueError(f"rope factor must be > 0, got {self.factor}")
        if self.frequency_factors and len(self.frequency_factors) != self.head_dim // 2:
            raise ValueError(f"frequency_factors must have head_dim / 2 = {self.head_dim // 2} entries, "
                             f"got {len(self.frequency_factors)}")
        half = self.head_dim // 2
        if self.kind == "longrope" and not len(self.short_factor) == len(self.long_factor) == half:
            raise ValueError(f"longrope's short_factor and long_factor must have {half} entries (the rotary "
                             f"size / 2), got {len(self.short_factor)} and {len(self.long_factor)}")

    @property
    def threshold(self) -> int | None:
        """The length past which a row's frequencies change (dynamic NTK: max_positions;
        LongRoPE: original_max_positions), or None where they never do."""
        return {"dynamic": self.max_positions, "longrope": self.original_max_positions}.get(self.kind)


def rope_parameters(config: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE dict of an HF config.json, old (`rope_scaling` + `rope_theta`) or new
    (`rope_parameters`, transformers >= 5) layout; with `layer_type` ("full_attention" or
    "sliding_attention"), that type's own (Gemma 3: a dict per type, or in the old layout
    `rope_local_base_freq` for the sliding layers)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if "full_attention" in params or "sliding_attention" in params:
        params = params.get(layer_type or "full_attention") or {}
    elif layer_type == "sliding_attention":
        params = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10000.0)}
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    if config.get("model_type") == "phi3" and params["rope_type"] in ("su", "yarn"):
        params["rope_type"] = "longrope"  # Phi-3's older names of it, as transformers' Phi3Config reads them
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return params


def rotary_size(config: dict[str, Any], head_dim: int, layer_type: str | None = None) -> int:
    """The rotated part of a head: head_dim x partial_rotary_factor (1 unless the config says)."""
    params = rope_parameters(config, layer_type)
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor")) or 1.0
    return int(head_dim * float(partial))


def rope_config(config: dict[str, Any], head_dim: int, layer_type: str | None = None) -> RopeConfig:
    params = rope_parameters(config, layer_type)
    max_positions = int(config.get("max_position_embeddings", 2048))
    original = params.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    original = int(original or max_positions)
    kind = str(params["rope_type"])
    longrope = {}
    if kind == "longrope":  # transformers' _compute_longrope_parameters
        factor = params.get("factor") or max_positions / original
        attention = params.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        longrope = {"short_factor": tuple(float(f) for f in params.get("short_factor") or ()),
                    "long_factor": tuple(float(f) for f in params.get("long_factor") or ()),
                    "attention_factor": float(attention)}  # fmt: skip
    return RopeConfig(
        head_dim=rotary_size(config, head_dim, layer_type),
        theta=float(params["rope_theta"]),
        kind=kind,
        factor=float(params.get("factor") or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_positions=original,
        max_positions=max_positions,
        **longrope,
    )


def inverse_frequencies(rope: RopeConfig, num_positions: int) -> torch.Tensor:
    """inv_freq [D/2] float32 for a sequence of `num_positions` positions."""
    dim = rope.head_dim
    theta = rope.theta
    if rope.kind == "dynamic" and num_positions > rope.max_positions:
        # NTK-aware: base * (factor * L / L_max - (factor - 1)) ^ (D / (D - 2)).
        stretch = rope.factor * num_positions / rope.max_positions - (rope.factor - 1)
        theta = theta * stretch ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim  # host maths (below)
    if rope.kind == "longrope":  # as transformers rounds it: 1 / (factor x theta^(2i/D))
        factors = rope.long_factor if num_positions > rope.original_max_positions else rope.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if rope.frequency_factors:
        inv_freq = inv_freq / torch.tensor(rope.frequency_factors, dtype=torch.float32, device="cpu")
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        return _llama3_frequencies(inv_freq, rope)
    return inv_freq


def _llama3_frequencies(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    low_freq_wavelen = rope.original_max_positions / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_positions / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_positions / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryTables:
    """cos and signed sin tables [P, D] grown on demand, in the model's dtype.

    With a `local` RoPE the tables are [P, 2D]: `rope`'s columns, then `local`'s. Every
    caller indexes them by position as it would [P, D] ones, and each layer takes its half
    (models/native.py `Attention`), so a model whose sliding layers rotate with their own base (Gemma 3) goes
    through the engine's steps unchanged.

    `rotate_half(x) = cat(-x2, x1) = roll(x, D/2) * [-1.., +1..]`, so the sign is folded
    into the sin table and applying RoPE is two multiplies, one roll and one add.
    """

    def __init__(
        self,
        rope: RopeConfig,
        dtype: torch.dtype,
        capacity: int = 256,
        device: str | torch.device = "cpu",
        local: RopeConfig | None = None,
    ):
        self.rope = rope
        self.local = local  # the sliding layers' own RoPE (Gemma 3): tables [P, 2D], `rope`'s then its
        self.dtype = dtype
        self.device = torch.device(device)
        if rope.threshold is not None:
            capacity = min(capacity, rope.threshold)
        self.cos, self.sin = self._build(capacity, 0)
        self.long: tuple[torch.Tensor, torch.Tensor] | None = None  # longrope's past the threshold

    def _build(self, num_positions: int, freq_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for positions [0, num_positions) with the frequencies of a sequence of
        `freq_positions` positions (only dynamic NTK depends on it)."""
        return self._rotations(torch.arange(num_positions, device="cpu"), freq_positions)

    def _rotations(self, positions: torch.Tensor, freq_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [P, D] of `positions` [P] (any device) with the frequencies of a
        sequence of `freq_positions` positions."""
        ropes = (self.rope,) if self.local is None else (self.rope, self.local)
        cos, sin = [], []
        for rope in ropes:
            inv_freq = inverse_frequencies(rope, freq_positions)  # [D/2]
            freqs = positions.cpu().float()[:, None] * inv_freq[None, :]  # [P, D/2]
            half = inv_freq.shape[0]
            sign = torch.cat([-torch.ones(half, device="cpu"), torch.ones(half, device="cpu")])  # [D]
            angles = torch.cat([freqs, freqs], dim=-1)  # [P, D]
            # Computed in float32 on the CPU (transformers' numbers), then moved once.
            scale = rope.attention_factor  # 1 but for longrope
            cos.append((angles.cos() * scale).to(self.dtype))
            sin.append((angles.sin() * (sign * scale)).to(self.dtype))
        return torch.cat(cos, dim=-1).to(self.device), torch.cat(sin, dim=-1).to(self.device)

    def tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin covering positions [0, num_positions)."""
        threshold = self.rope.threshold
        if threshold is not None and num_positions > threshold:
            if self.rope.kind == "dynamic":
                # The base depends on the current length: recompute, never cache (as transformers).
                return self._build(num_positions, num_positions)
            # longrope: one set of long frequencies for every length past the threshold
            if self.long is None or self.long[0].shape[0] < num_positions:
                capacity = max(num_positions, 2 * (0 if self.long is None else self.long[0].shape[0]))
                self.long = self._build(capacity, threshold + 1)
            return self.long
        if num_positions > self.cos.shape[0]:
            capacity = max(num_positions, 2 * self.cos.shape[0])
            if threshold is not None:
                capacity = min(capacity, threshold)
            self.cos, self.sin = self._build(capacity, 0)
        return self.cos, self.sin


    def at(self, positions: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [..., D] of `positions` [...], each with the frequencies of
        `lengths` [...] (same shape): the length of the token's own sequence in this forward.
        Differs from `tables` only for rows past the RoPE's threshold (dynamic NTK, longrope)."""
        threshold = self.rope.threshold
        cos, sin = self.tables(int(positions.max()) + 1 if threshold is None
                               else min(int(positions.max()) + 1, threshold))  # fmt: skip
        limit = cos.shape[0] - 1
        cos, sin = cos[positions.clamp(max=limit)], sin[positions.clamp(max=limit)]
        if threshold is None or int(lengths.max()) <= threshold:
            return cos, sin
        for length in lengths[lengths > threshold].unique().tolist():  # each long row's own base
            chosen = lengths == length
            cos[chosen], sin[chosen] = self._rotations(positions[chosen], length)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D], cos/sin broadcastable to it -> x rotated by its positions."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
