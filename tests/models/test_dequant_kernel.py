"""decodekit::dequantize (csrc/dequant.cpp): a quantised layer's prefill weight in one pass,
the same bits as qlinear.py's `dequantize` in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from decodekit.models import kernels, qlinear
from decodekit.models.qlinear import PACKED_MAX_ROWS, QuantizedLinear
from decodekit.models.quant_grid import QuantSpec, dequantize, pack_int4

needs_kernels = pytest.mark.skipif(
    not kernels.available(), reason=f"native kernels unavailable: {kernels.status().reason}"
)


def _codes(bits: int, n: int, k: int, groups: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    top = 8 if bits == 4 else 128
    codes = torch.randint(-top, top, (n, k), generator=g, dtype=torch.int8)
    return codes, torch.randn(n, groups, generator=g).abs() * 0.01 + 1e-4


SHAPES = [(5, 96, 3), (7, 33, 1), (3, 64, 2), (9, 130, 5), (64, 896, 14)]  # (N, K, groups)


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k", "groups"), SHAPES)
def test_the_op_gives_the_bits_of_the_torch_dequantisation(bits, dtype, n, k, groups):
    codes, scales = _codes(bits, n, k, groups)
    stored = pack_int4(codes) if bits == 4 else codes  # int4: two codes a byte, halves layout
    out = torch.empty(n, k, dtype=dtype)
    torch.ops.decodekit.dequantize(stored, scales, k, out)
    expected = dequantize(codes, scales, dtype)
    assert out.dtype == dtype and out.shape == (n, k)
    assert torch.equal(out.view(torch.int16) if dtype == torch.bfloat16 else out.view(torch.int32),
                       expected.view(torch.int16) if dtype == torch.bfloat16 else expected.view(torch.int32))
    reused = kernels.dequantize(stored, scales, k, dtype)  # into this thread's reused buffer
    assert torch.equal(reused.float(), expected.float())


@needs_kernels
@pytest.mark.parametrize(("bits", "group"), [(4, None), (4, 32), (8, None), (8, 64)])
def test_a_prefill_gives_the_same_outputs_with_and_without_the_op(bits, group, monkeypatch):
    g = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(128, 48, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 128, generator=g) / 10)
    layer = QuantizedLinear.from_linear(linear, QuantSpec(bits=bits, group_size=group))
    x = torch.randn(PACKED_MAX_ROWS + 7, 128, generator=g)  # a prefill: above the kernels' rows
    calls = []
    # an int4 layer keeps its codes in the GEMV kernel's layout only, and dequantises from it
    name = "dequantize_blocks" if bits == 4 else "dequantize"
    op = getattr(torch.ops.decodekit, name)
    counted = lambda *args: calls.append(1) or op(*args)  # noqa: E731
    monkeypatch.setattr(qlinear.torch.ops.decodekit, name, counted, raising=False)
    with torch.no_grad():
        fast = layer(x)
        assert calls, f"the prefill did not run decodekit::{name}"
        monkeypatch.setattr(kernels, "eager_op", lambda *tensors: False)
        slow = layer(x)
    assert torch.equal(fast, slow)


@needs_kernels
def test_bad_operands_are_refused_with_the_expected_shape():
    codes, scales = _codes(8, 4, 32, 2)
    with pytest.raises(RuntimeError, match="codes hold 32 bytes a row"):
        torch.ops.decodekit.dequantize(codes, scales, 64, torch.empty(4, 64))
    with pytest.raises(RuntimeError, match="G dividing K"):
        torch.ops.decodekit.dequantize(codes, torch.ones(4, 3), 32, torch.empty(4, 32))
    with pytest.raises(RuntimeError, match="out must be a contiguous CPU float32 \\[4, 32\\]"):
        torch.ops.decodekit.dequantize(codes, scales, 32, torch.empty(4, 31))
    with pytest.raises(RuntimeError, match="int8 \\[N, K\\] or uint8"):
        torch.ops.decodekit.dequantize(codes.float(), scales, 32, torch.empty(4, 32))


@needs_kernels
def test_a_prefill_that_autograd_saves_does_not_use_the_reused_buffer():
    g = torch.Generator().manual_seed(2)
    layers = []
    for _ in range(2):
        linear = torch.nn.Linear(64, 32, bias=False)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(32, 64, generator=g))
        layers.append(QuantizedLinear.from_linear(linear, QuantSpec(bits=4, group_size=None)))
    x = torch.randn(PACKED_MAX_ROWS + 1, 64, generator=g, requires_grad=True)
    alone = x.detach().clone().requires_grad_()
    layers[0](alone).sum().backward()  # the gradient with nothing between forward and backward
    y = layers[0](x)
    layers[1](torch.randn(PACKED_MAX_ROWS + 1, 64, generator=g))  # another prefill before backward
    y.sum().backward()
    assert torch.equal(x.grad, alone.grad)
    # In the prefill's dtype (bfloat16 where the CPU multiplies it natively, else float32).
    weight = layers[0].dequantized_weight(qlinear.prefill_dtype()).float()
    torch.testing.assert_close(x.grad, weight.sum(0).expand_as(x), atol=0.1, rtol=0.02)
