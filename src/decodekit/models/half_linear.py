"""Half-precision (bfloat16, float16) linear layers on CPU paths PyTorch serves slowly, for
models/native.py's `_linear`: one row as a matrix-vector product (where decodekit's kernels
are not built) and many rows of bfloat16 through a float32 GEMM (where the CPU has no native
bfloat16 product)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decodekit.models import kernels

# Their weights stay row-major (native.py `transpose_weight_layout`).
GEMV_DTYPES = (torch.bfloat16, torch.float16)


def one_row_gemv(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` for x holding one row, as a matrix-vector product over the row-major
    [out, in] weight: x [..., in] -> [..., out].

    The bfloat16/float16 decode path where decodekit's kernels are not built
    (models/kernels.py, which `_linear` tries first): at one row, `torch.mv` over row-major bfloat16 weights
    streams them at memory speed, while `F.linear` takes oneDNN's GEMM path, 1.5x slower
    (measured on this AVX-512-BF16 CPU, one thread: 896 -> 9728, 837 against 1,253 us; float32
    F.linear is 1,320 us). BENCHMARKS.md, "Real model shapes: dtype, device and speed".
    """
    out = torch.mv(layer.weight, x.reshape(-1))  # [out]
    if layer.bias is not None:
        out = out + layer.bias
    return out.view(*x.shape[:-1], out.shape[0])


def widened_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` for a bfloat16 layer on a CPU without a native bfloat16 product (AVX2 and
    AVX-512 without BF16: qlinear's `prefill_dtype`), rows past the kernels' (a prefill): its
    weight widened to float32 (exact) into this thread's scratch buffer and one float32 GEMM
    of the widened x, rounded back to bfloat16. PyTorch's bfloat16 GEMM emulates the product
    there: on the Zen 3 at 896 -> 4864, 9 / 16 / 64 / 200 rows ran at 1.3x / 2.1x / 4.4x / 6.1x
    its speed this way (BENCHMARKS.md, 2026-11-28). Products exact, float32 sums, as it has."""
    weight = layer.weight
    wide = kernels.scratch(*weight.shape, torch.float32).copy_(weight)
    bias = None if layer.bias is None else layer.bias.float()
    return F.linear(x.float(), wide, bias).to(x.dtype)
