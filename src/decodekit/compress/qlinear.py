"""`QuantizedLinear`: a drop-in `nn.Linear` whose weight stays in integers in memory.

Codes are kept as int8 [N, K] for 5..8 bits and packed two per byte, uint8 [N, ceil(K/2)],
for 2..4 bits, with float32 scales [N, G] (one per output channel, or per group of K/G
input features). The forward pass dequantises per matmul, so only one layer's float
weight exists at a time:

- per channel: y = (x Qᵀ) · s, scaling the output instead of the weight (one multiply
  per output instead of per weight; about 1.7x faster at batch 1 on CPU);
- per group: y = x (Q · s)ᵀ with the scales broadcast over each group;
- bfloat16 input, per channel, unpacked codes: `torch._weight_int8pack_mm`, PyTorch's CPU
  int8-weight kernel (it only has a fast path for bf16; for float32 it is ~10x slower than
  dequantising, measured on PyTorch 2.13 CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decodekit.compress.quantize import QuantSpec, dequantize, quantize_rtn


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack codes int8 [N, K] in [-8, 7] two per byte: uint8 [N, ceil(K/2)].

    Column 2j goes to the low nibble of byte j, column 2j+1 to the high nibble.
    """
    n, k = q.shape
    if k % 2:
        q = torch.cat([q, torch.zeros(n, 1, dtype=q.dtype)], dim=1)
    nibbles = (q.to(torch.int16) & 0xF).to(torch.uint8).reshape(n, -1, 2)
    return nibbles[..., 0] | (nibbles[..., 1] << 4)


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """Inverse of `pack_int4`: int8 [N, in_features] from uint8 [N, ceil(K/2)]."""
    p = packed.to(torch.int16)
    nibbles = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(packed.shape[0], -1)
    signed = (nibbles ^ 8) - 8  # sign-extend 4-bit two's complement
    return signed[:, :in_features].to(torch.int8)


def int8_kernel_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., K] bf16 times per-channel int8 weight [N, K] with scales [N] via the CPU kernel."""
    lead = x.shape[:-1]
    y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), q, scales.to(x.dtype))  # [M, N]
    return y.reshape(*lead, q.shape[0])


def _has_int8_kernel() -> bool:
    return hasattr(torch, "_weight_int8pack_mm")


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
        module.set_codes(codes, scales)
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
        per_channel = self.spec.group_size is None
        if per_channel and not self.packed and x.dtype == torch.bfloat16 and _has_int8_kernel():
            y = int8_kernel_matmul(x, self.qweight, self.scales[:, 0])
        elif per_channel:
            y = F.linear(x, self.codes().to(x.dtype)) * self.scales[:, 0].to(x.dtype)
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
