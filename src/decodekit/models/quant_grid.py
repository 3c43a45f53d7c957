"""The integer grid of a quantised linear layer (models/qlinear.py's `QuantizedLinear`):
its spec, the round-to-nearest quantiser, dequantisation, int4 packing and the unpacked
matmuls of the fallback path.

Grids are symmetric: b bits give the levels -qmax..qmax with qmax = 2^(b-1) - 1 (int8:
±127, int4: ±7, int3: ±3) and one float scale per output channel or per group of
`group_size` consecutive input features (`QuantSpec`). Round-to-nearest absmax scaling
(`quantize_rtn`) maps the largest |w| of a channel or group onto qmax, so nothing is
clipped and the error of every weight is at most scale / 2; rounding is half away from
zero (seed 000's worked example: 0.5 -> 1; `torch.round` rounds half to even).

Codes are kept as int8 [N, K] for 5..8 bits and packed two per byte, uint8 [N, ceil(K/2)],
for 2..4 bits, with float32 scales [N, G] (one per output channel, or per group of K/G
input features); that is what checkpoints store. The stored range is the bits' whole
two's-complement range, -qmax - 1..qmax: decodekit's quantisers use ±qmax, GGUF's q4_0 and
q8_0 blocks (models/gguf_tensors.py) may hold -8 and -128.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decodekit.models import kernels

ACTIVATION_BLOCK = kernels.A8_BLOCK  # inputs per activation scale (activation_bits 8)


@dataclass(frozen=True)
class QuantSpec:
    """Symmetric integer grid: `bits` in 2..8, one scale per channel or per group; and whether
    the layer quantises its input too (`activation_bits` 8: W8A8 / W4A8, qlinear.py's docstring)."""

    bits: int = 8
    group_size: int | None = None  # None: one scale per output channel (row)
    activation_bits: int | None = None  # None: weight-only; 8: x in int8 per block of 32

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int):
            raise TypeError(f"bits must be an int, got {self.bits!r}")
        if not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be in 2..8, got {self.bits}")
        if self.group_size is not None and (
            isinstance(self.group_size, bool)
            or not isinstance(self.group_size, int)
            or self.group_size < 1
        ):
            raise ValueError(f"group_size must be a positive int or None, got {self.group_size!r}")
        check_activation_bits(self.activation_bits, self.group_size)

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def num_groups(self, in_features: int) -> int:
        """Scales per row for a layer with `in_features` inputs."""
        if self.group_size is None:
            return 1
        if in_features % self.group_size:
            raise ValueError(
                f"group_size {self.group_size} must divide the layer's in_features {in_features}"
            )
        return in_features // self.group_size


def check_activation_bits(activation_bits: int | None, group_size: int | None) -> None:
    """activation_bits must be None (weight-only) or 8, and then the weights' groups whole
    activation blocks (per channel, or a multiple of 32 inputs)."""
    if activation_bits is None:
        return
    if isinstance(activation_bits, bool) or not isinstance(activation_bits, int):
        raise TypeError(f"activation_bits must be an int or None, got {activation_bits!r}")
    if activation_bits != 8:
        raise ValueError(f"activation_bits must be None (weight-only) or 8, got {activation_bits}")
    if group_size is not None and group_size % ACTIVATION_BLOCK:
        raise ValueError(
            f"activation_bits 8 needs group_size None or a multiple of {ACTIVATION_BLOCK}, got {group_size}"
        )


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as the W8A8 / W4A8 layers see it: per block of 32 inputs (the last one zero
    padded) d = max|x| / 127, q = round(x * (1 / d)) within ±127 (ties to even), x̂ = q * d,
    computed in float32 (llama.cpp's q8_0; csrc/gemv_a8.cpp). Returns x̂ in x's dtype."""
    k = x.shape[-1]
    blocks = -(-k // ACTIVATION_BLOCK)
    xf = F.pad(x.to(torch.float32), (0, blocks * ACTIVATION_BLOCK - k))
    xb = xf.reshape(*x.shape[:-1], blocks, ACTIVATION_BLOCK)  # [..., blocks, 32]
    d = xb.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xb * inverse).clamp(-127, 127)
    return (q * d).reshape(xf.shape)[..., :k].to(x.dtype)


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest integer, ties away from zero (seed 000: 0.5 -> 1)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def scale_from_absmax(absmax: torch.Tensor, qmax: int) -> torch.Tensor:
    # An all-zero channel or group quantises to zeros with any scale; 1 avoids 0/0.
    return torch.where(absmax > 0, absmax / qmax, torch.ones_like(absmax))


def absmax_scales(weight: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Scales [N, G] mapping each row's (or group's) largest |w| onto qmax."""
    n, k = weight.shape
    groups = spec.num_groups(k)
    absmax = weight.detach().to(torch.float32).reshape(n, groups, k // groups).abs().amax(-1)
    return scale_from_absmax(absmax, spec.qmax)


def quantize_with_scales(weight: torch.Tensor, scales: torch.Tensor, qmax: int) -> torch.Tensor:
    """Integer codes int8 [N, K] of weight [N, K] under scales [N, G], clamped to ±qmax."""
    n, k = weight.shape
    group = k // scales.shape[1]
    w = weight.detach().to(torch.float32).reshape(n, scales.shape[1], group)
    q = round_half_away(w / scales.unsqueeze(-1)).clamp(-qmax, qmax)
    return q.reshape(n, k).to(torch.int8)


def dequantize(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Weight [N, K] in `dtype` from codes [N, K] and scales [N, G] (group = K / G), computed
    in that dtype (codes up to ±127 are exact in bfloat16)."""
    n, k = q.shape
    groups = scales.shape[1]
    w = q.to(dtype).reshape(n, groups, k // groups) * scales.to(dtype).unsqueeze(-1)
    return w.reshape(n, k)


def quantize_rtn(weight: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest absmax quantisation. Returns codes int8 [N, K] and scales [N, G]."""
    scales = absmax_scales(weight, spec)
    return quantize_with_scales(weight, scales, spec.qmax), scales


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack codes int8 [N, K] in [-8, 7] two per byte: uint8 [N, H], H = ceil(K/2).

    Byte j of a row holds column j in its low nibble and column H + j in its high nibble
    (the last high nibble is 0 when K is odd), so unpacking yields the two halves of the
    row without interleaving.
    """
    n, k = q.shape
    half = (k + 1) // 2
    low, high = q[:, :half].to(torch.int16), q[:, half:].to(torch.int16)
    if high.shape[1] < half:
        high = torch.cat([high, high.new_zeros(n, 1)], dim=1)
    return ((low & 0xF) | ((high & 0xF) << 4)).to(torch.uint8)


def unpack_int4_halves(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes int8 [N, H] of columns [0, H) and [H, 2H) from uint8 [N, H]."""
    # Arithmetic right shifts of the bytes viewed as int8 sign-extend each nibble.
    low = (packed << 4).view(torch.int8) >> 4
    high = packed.view(torch.int8) >> 4
    return low, high


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """Inverse of `pack_int4`: int8 [N, in_features] from uint8 [N, ceil(K/2)]."""
    low, high = unpack_int4_halves(packed)
    return torch.cat([low, high], dim=1)[:, :in_features]


def int4_halves_matmul(x: torch.Tensor, packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """x [..., K] times the packed int4 codes [N, ceil(K/2)]ᵀ (unscaled). Returns [..., N]."""
    low, high = unpack_int4_halves(packed)
    half = packed.shape[1]
    y = F.linear(x[..., :half], low.to(x.dtype))
    return y + F.linear(x[..., half:], high[:, : in_features - half].to(x.dtype))


def grouped_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Σ_g (x_g Q_gᵀ) s_g for x [..., K], codes [N, K], scales [N, G]. Returns [..., N]."""
    n, k = codes.shape
    groups = scales.shape[1]
    lead = x.shape[:-1]
    xg = x.reshape(-1, groups, k // groups).transpose(0, 1)  # [G, M, g]
    wg = codes.to(x.dtype).reshape(n, groups, k // groups).permute(1, 2, 0)  # [G, g, N]
    y = torch.bmm(xg, wg) * scales.T.to(x.dtype).unsqueeze(1)  # [G, M, N]
    return y.sum(0).reshape(*lead, n)
