"""`QuantizedLinear`: a drop-in `nn.Linear` whose weight stays in integers in memory, and
the integer grid it stores (compress/ writes it, `load_model` of a compressed directory
reads it: models/compressed.py).

Grids are symmetric: b bits give the levels -qmax..qmax with qmax = 2^(b-1) - 1 (int8:
±127, int4: ±7, int3: ±3) and one float scale per output channel or per group of
`group_size` consecutive input features (`QuantSpec`). Round-to-nearest absmax scaling
(`quantize_rtn`) maps the largest |w| of a channel or group onto qmax, so nothing is
clipped and the error of every weight is at most scale / 2; rounding is half away from
zero (seed 000's worked example: 0.5 -> 1; `torch.round` rounds half to even).

Codes are kept as int8 [N, K] for 5..8 bits and packed two per byte, uint8 [N, ceil(K/2)],
for 2..4 bits, with float32 scales [N, G] (one per output channel, or per group of K/G
input features). The forward pass never builds more than one layer's float weight, and
picks one of these (each a named function below):

- per channel: y = (x Qᵀ) · s, scaling the N outputs instead of the N·K weights;
- per channel, packed int4: the same, as two matmuls over the two halves of the input
  (`int4_halves_matmul`), so the nibbles are never interleaved back into one matrix;
- per group, fewer rows than the group size (decoding): y = Σ_g (x_g Q_gᵀ) · s_g as one
  batched matmul (`grouped_matmul`), again scaling outputs rather than weights;
- per group otherwise (prefill): dequantise Ŵ = Q · s and run one matmul;
- bfloat16 input, per channel, int8 codes, K % 16 == 0: `torch._weight_int8pack_mm`, the CPU
  int8-weight kernel. It has a fast path only for bf16 activations; with float32 ones
  it was several times slower than dequantising (PyTorch 2.13 CPU), so it is not used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class QuantSpec:
    """Symmetric integer grid: `bits` in 2..8, one scale per channel or per group."""

    bits: int = 8
    group_size: int | None = None  # None: one scale per output channel (row)

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


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Float32 weight [N, K] from codes [N, K] and scales [N, G] (group = K / G)."""
    n, k = q.shape
    groups = scales.shape[1]
    w = q.to(torch.float32).reshape(n, groups, k // groups) * scales.to(torch.float32).unsqueeze(-1)
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


def int8_kernel_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., K] bf16 times per-channel int8 weight [N, K] with scales [N] via the CPU kernel."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # the kernel needs a contiguous last dim
    y = torch._weight_int8pack_mm(rows, q, scales.to(x.dtype))  # [M, N]
    return y.reshape(*lead, q.shape[0])


def int8_kernel_fits(x: torch.Tensor, in_features: int) -> bool:
    """Whether `int8_kernel_matmul` applies: bf16 input on CPU and K a multiple of 16.

    With other K, `torch._weight_int8pack_mm` segfaults on PyTorch 2.13 CPU (measured with
    K = 8, 24, 37, 40, 200), so it is only called on shapes where it is known to work.
    """
    return (
        x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and in_features % 16 == 0
        and hasattr(torch, "_weight_int8pack_mm")
    )


class QuantizedLinear(nn.Module):
    """y = x Ŵᵀ + b with Ŵ = codes · scales kept as integers (see module docstring)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int = 8,
        group_size: int | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.spec = QuantSpec(bits, group_size)
        self.in_features = in_features
        self.out_features = out_features
        groups = self.spec.num_groups(in_features)
        if self.packed:
            codes = torch.zeros(out_features, (in_features + 1) // 2, dtype=torch.uint8)
        else:
            codes = torch.zeros(out_features, in_features, dtype=torch.int8)
        self.register_buffer("qweight", codes)
        self.register_buffer("scales", torch.ones(out_features, groups, dtype=torch.float32))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @property
    def packed(self) -> bool:
        return self.spec.bits <= 4

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        spec: QuantSpec,
        codes: torch.Tensor | None = None,
        scales: torch.Tensor | None = None,
    ) -> QuantizedLinear:
        """Quantise `linear` (round-to-nearest), or wrap given codes [N, K] and scales [N, G]."""
        if codes is None or scales is None:
            codes, scales = quantize_rtn(linear.weight, spec)
        has_bias = linear.bias is not None
        module = cls(linear.in_features, linear.out_features, spec.bits, spec.group_size, has_bias)
        module.to(linear.weight.device).set_codes(codes, scales)
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach().to(torch.float32))
        return module

    def set_codes(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Store codes int8 [N, K] (in ±qmax) and scales [N, G]."""
        n, k = self.out_features, self.in_features
        if codes.shape != (n, k) or scales.shape != self.scales.shape:
            raise ValueError(
                f"codes {tuple(codes.shape)} / scales {tuple(scales.shape)} do not fit a "
                f"{n}x{k} layer with scales {tuple(self.scales.shape)}"
            )
        qmax = self.spec.qmax
        if codes.numel() and (codes.min() < -qmax or codes.max() > qmax):
            raise ValueError(f"codes must lie in [-{qmax}, {qmax}] for {self.spec.bits} bits")
        codes = codes.to(torch.int8)
        self.qweight.copy_(pack_int4(codes) if self.packed else codes)
        self.scales.copy_(scales.to(torch.float32))

    def codes(self) -> torch.Tensor:
        """Integer codes int8 [N, K]."""
        return unpack_int4(self.qweight, self.in_features) if self.packed else self.qweight

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Ŵ [N, K] in `dtype`."""
        return dequantize(self.codes(), self.scales).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scales = self.scales.to(x.dtype)  # [N, G]
        if self.spec.group_size is None:
            if self.packed:
                y = int4_halves_matmul(x, self.qweight, self.in_features) * scales[:, 0]
            elif int8_kernel_fits(x, self.in_features):
                y = int8_kernel_matmul(x, self.qweight, scales[:, 0])
            else:
                y = F.linear(x, self.qweight.to(x.dtype)) * scales[:, 0]
        elif x.numel() // self.in_features < self.spec.group_size:
            y = grouped_matmul(x, self.codes(), scales)
        else:
            y = F.linear(x, self.dequantized_weight(x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        group = "channel" if self.spec.group_size is None else f"group={self.spec.group_size}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.spec.bits}, {group}, bias={self.bias is not None}"
        )
