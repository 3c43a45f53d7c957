"""Half-precision (bfloat16, float16) linear layers on CPU paths PyTorch serves slowly, for
models/native.py's `_linear`: one row as a matrix-vector product (where decodekit's kernels
are not built) and many rows of bfloat16 through a float32 GEMM (where the CPU has no native
bfloat16 product).

Half weights in a float32 model (`keep_half_weights`): a checkpoint stored in bfloat16 or
float16 that runs in float32 on the CPU (registry.py `resolve_dtype`: float16 always, bfloat16
where this CPU's bfloat16 arithmetic is slow) keeps its linear layers' weights as stored, and
everything else (activations, norms, the KV cache, a tied embedding and output head) in
float32. Widening a half value is exact, so the products are the float32 model's; the weights
take half the memory, and decodekit's kernels read them as they are (a decode step streams half
the bytes); past the kernels' rows, `widened_linear`. llama.cpp keeps a GGUF's f16 and bf16
weights as stored too (and rounds the activations to them; here they stay float32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decodekit.models import kernels
from decodekit.models.hugepages import on_huge_pages

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
    its speed this way (BENCHMARKS.md, 2026-11-28). Products exact, float32 sums, as it has.
    Also a float32 model's half weights (`keep_half_weights`) wherever the kernels do not run:
    off the CPU, or where autograd needs the weight, a widened copy instead of the scratch."""
    weight = layer.weight
    if weight.is_cpu and kernels.no_grad_needed(weight, x):
        wide = kernels.scratch(*weight.shape, torch.float32).copy_(weight)
    else:
        wide = weight.float()
    bias = None if layer.bias is None else layer.bias.float()
    return F.linear(x.float(), wide, bias).to(x.dtype)


class HalfWeightLinear(nn.Linear):
    """An nn.Linear of a float32 model whose weight is kept in bfloat16 or float16
    (`keep_half_weights`). models/native.py's `_linear` runs it as a plain Linear (the kernels
    read the half weight as it is; past their rows `widened_linear`); called itself (a layer
    with hooks: compress's calibration) it widens its weight for the call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


class HalfEmbedding(nn.Module):
    """The lookup of a tied embedding whose weight, the output head's, is kept in half precision
    (`keep_half_weights`): the rows read are widened to the model's dtype (`dtype`, float32),
    so the vocabulary is held once, as stored (a real vocabulary's head is a small model's
    largest matrix: Qwen2.5's 151,936 x 896, 545 MB a token in float32, 272 in float16)."""

    def __init__(self, weight: nn.Parameter, dtype: torch.dtype):
        super().__init__()
        self.weight = weight  # [V, H], the head's: its state-dict name is nn.Embedding's
        self.dtype = dtype

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight).to(self.dtype)


# The layers `_linear` runs as plain Linears (their own forward is not needed).
PLAIN_LINEARS = (nn.Linear, HalfWeightLinear)


def keep_half_weights(net: nn.Module, dtype: torch.dtype) -> int:
    """Store the linear layers' weights of a float32 `net` in `dtype` (bfloat16 or float16),
    row-major, as `HalfWeightLinear`s, their biases and every other tensor left in float32
    (module docstring); an embedding tied to one of them (the output head) becomes a
    `HalfEmbedding` over the same half weight. The values must be `dtype`'s (a checkpoint stored
    in it): they are rounded to it. Returns the layers converted."""
    if dtype not in GEMV_DTYPES:
        raise ValueError(f"half weights must be bfloat16 or float16, got {dtype}")
    found = [(name, module) for name, module in net.named_modules()
             if type(module) is nn.Linear and module.weight.dtype == torch.float32]  # fmt: skip
    halves: dict[int, nn.Parameter] = {}  # id of a float weight -> its half copy, one per tensor
    for name, module in found:
        with torch.device("meta"):
            half = HalfWeightLinear(module.in_features, module.out_features, bias=module.bias is not None)
        weight = module.weight
        if id(weight) not in halves:
            stored = on_huge_pages(weight.detach().to(dtype))
            halves[id(weight)] = nn.Parameter(stored, requires_grad=weight.requires_grad)
        half.weight, half.bias = halves[id(weight)], module.bias
        _replace(net, name, half)
    tied = [(name, module) for name, module in net.named_modules()
            if isinstance(module, nn.Embedding) and id(module.weight) in halves]  # fmt: skip
    for name, module in tied:
        _replace(net, name, HalfEmbedding(halves[id(module.weight)], module.weight.dtype))
    return len(found)


def _replace(net: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(net.get_submodule(parent_name) if parent_name else net, child, module)
