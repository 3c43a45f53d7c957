"""decodekit::rms_norm (csrc/norm.cpp): RMSNorm in one op on the eager CPU path (models/native.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from decodekit.models import kernels
from decodekit.models.native import RMSNorm

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the CPU kernels are not built here")


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The maths in float64: x / sqrt(mean(x²) + eps) * weight."""
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).float()


@needs_kernels
@pytest.mark.parametrize("width", [1, 7, 8, 64, 100, 896, 4099])
@pytest.mark.parametrize("shape", [(1,), (3,), (2, 5)])
def test_rms_norm_is_the_float64_value_rounded_within_float32_steps(width, shape):
    generator = torch.Generator().manual_seed(width)
    x = torch.randn(*shape, width, generator=generator) * 3
    weight = torch.randn(width, generator=generator)
    got = torch.ops.decodekit.rms_norm(x, weight, 1e-6)
    want = reference(x, weight, 1e-6)
    assert got.shape == x.shape and got.dtype == torch.float32
    # a sum of `width` squares in float32: relative error ~ width * 2^-24 at worst
    torch.testing.assert_close(got, want, rtol=4e-6 + width * 2**-24, atol=1e-6)
    # and as close to PyTorch's own as its rounding allows
    torch.testing.assert_close(got, weight * F.rms_norm(x, (width,), eps=1e-6), rtol=1e-5, atol=1e-6)


@needs_kernels
def test_rms_norm_uses_eps():
    x, weight = torch.zeros(1, 16), torch.ones(16)
    x[0, 0] = 1e-3
    got = torch.ops.decodekit.rms_norm(x, weight, 0.5)
    assert got[0, 0].item() == pytest.approx(1e-3 / (1e-6 / 16 + 0.5) ** 0.5, rel=1e-6)


@needs_kernels
def test_a_row_gets_the_same_bits_whatever_rows_share_the_call():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(9, 896, generator=generator)
    weight = torch.randn(896, generator=generator)
    together = torch.ops.decodekit.rms_norm(x, weight, 1e-5)
    for row in range(9):
        assert torch.equal(torch.ops.decodekit.rms_norm(x[row : row + 1], weight, 1e-5)[0], together[row])


@needs_kernels
def test_the_op_refuses_what_it_does_not_compute():
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.decodekit.rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match=r"weight must be \[8\]"):
        torch.ops.decodekit.rms_norm(torch.ones(2, 8), torch.ones(4), 1e-6)


@needs_kernels
def test_the_layer_runs_the_op_only_where_no_gradient_flows(monkeypatch):
    norm = RMSNorm(32, 1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(2, 3, 32)
    calls = []
    op = torch.ops.decodekit.rms_norm

    def counted(*args):
        calls.append(1)
        return op(*args)

    monkeypatch.setattr(torch.ops.decodekit, "rms_norm", counted, raising=False)
    with torch.no_grad():
        eager = norm(x)
    assert calls == [1]
    # with a gradient to compute (the weight is a Parameter), the autograd-able ATen path runs
    trained = norm(x)
    trained.sum().backward()
    assert calls == [1] and norm.weight.grad is not None
    torch.testing.assert_close(eager, trained.detach(), rtol=1e-5, atol=1e-6)
