"""How NativeLM applies a linear layer: `apply_linear` picks decodekit's kernels, the
one-row GEMV, a widened GEMM for half weights, or the layer's own forward; `rowwise_linear`
is the batch-invariant mode's (models/native.py's docstring)."""

from __future__ import annotations

import torch
from torch import nn

from decodekit.models import kernels
from decodekit.models.half_linear import GEMV_DTYPES, PLAIN_LINEARS, one_row_gemv, widened_linear
from decodekit.models.qlinear import prefill_dtype


def rowwise_linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`layer` applied to each token on its own: x [B, T, in] -> [B, T, out].

    The batch-invariant mode's linear layers (module docstring): a token's output is the
    same [1, in] product whatever else shares the forward. One call with M > 1 rows would
    run BLAS's GEMM kernel, whose rounding differs from the M = 1 kernel a lone decoding
    row gets (measured: ~1e-6 relative per layer, ~1e-5 in the logits). An `nn.Linear`
    runs as one batched matmul of [1, in] x [in, out] products over a broadcast weight
    (each product computed on its own, ~2x faster than a Python loop); any other layer
    (compress/'s quantised ones) is called once per token.
    """
    rows = x.reshape(-1, x.shape[-1])  # [N, in]
    if type(layer) in PLAIN_LINEARS:
        weight = layer.weight.t().to(rows.dtype)  # [in, out]; half weights of a float32 model widened
        out = torch.bmm(rows[:, None], weight.expand(rows.shape[0], *weight.shape))[:, 0]
        if layer.bias is not None:
            out = out + layer.bias
    else:
        out = torch.cat([layer(rows[i : i + 1]) for i in range(rows.shape[0])])  # [N, out]
    return out.view(*x.shape[:-1], out.shape[-1])


def apply_linear(layer: nn.Module, x: torch.Tensor, rowwise: bool) -> torch.Tensor:
    if rowwise:
        return rowwise_linear(layer, x)
    # Anything but a plain Linear (QuantizedLinear, ConcatLinear: their own forward), or a layer
    # with hooks (compress's calibration), is called; a decode step makes ~100 such calls, so
    # this test comes first and costs two lookups.
    if type(layer) not in PLAIN_LINEARS or layer._forward_pre_hooks or layer._forward_hooks:
        return layer(x)
    weight = layer.weight
    # x float32 over half weights: a float32 model keeping its checkpoint's half weights
    # (half_linear.py `keep_half_weights`), which the kernels read as they are
    if (weight.is_cpu and (x.dtype == weight.dtype or x.dtype == torch.float32)
            and weight.dtype in kernels.FLOAT_DTYPES
            and x.numel() <= kernels.max_rows(weight.dtype, x.dtype) * x.shape[-1]
            and (kernels.traceable() if torch.compiler.is_compiling() else kernels.available())):  # fmt: skip
        return kernels.float_linear(x, weight, layer.bias)  # decodekit's GEMV / GEMM (models/kernels.py)
    if x.dtype != weight.dtype:  # half weights, float32 x: one float32 GEMM over the weight widened
        return widened_linear(layer, x)
    if (x.numel() == x.shape[-1] and weight.dtype in GEMV_DTYPES
            and weight.is_contiguous() and weight.is_cpu):  # fmt: skip
        return one_row_gemv(layer, x)
    if (weight.dtype == torch.bfloat16 and weight.is_cpu and x.dtype == torch.bfloat16
            and prefill_dtype() == torch.float32 and kernels.no_grad_needed(weight, x)):  # fmt: skip
        return widened_linear(layer, x)
    return layer(x)
