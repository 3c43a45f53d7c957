"""models/half_linear.py's bfloat16 prefill path: a float32 GEMM over the widened weight where
the CPU has no native bfloat16 product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from decodekit.models import half_linear, linear


def _layer(bias: bool) -> nn.Linear:
    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(96, 40, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 96, generator=g) / 10)
        if bias:
            layer.bias.copy_(torch.randn(40, generator=g))
    return layer.bfloat16()


@pytest.mark.parametrize("bias", [True, False])
def test_many_bfloat16_rows_run_one_float32_gemm_where_bfloat16_is_emulated(monkeypatch, bias):
    layer = _layer(bias)
    x = torch.randn(2, 20, 96, generator=torch.Generator().manual_seed(1)).bfloat16()
    monkeypatch.setattr(linear, "prefill_dtype", lambda: torch.float32)
    calls = []
    widened = half_linear.widened_linear
    monkeypatch.setattr(linear, "widened_linear", lambda *a: calls.append(1) or widened(*a))
    with torch.no_grad():
        out = linear.apply_linear(layer, x, rowwise=False)
        again = linear.apply_linear(layer, x, rowwise=False)  # the reused buffer, refilled
    expected = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
    assert calls == [1, 1] and out.dtype == torch.bfloat16 and out.shape == (2, 20, 40)
    assert torch.equal(out, expected.bfloat16()) and torch.equal(again, out)


def test_a_native_bfloat16_product_or_a_gradient_keeps_the_layer_call(monkeypatch):
    layer = _layer(True)
    x = torch.randn(20, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    monkeypatch.setattr(linear, "widened_linear", lambda *a: pytest.fail("widened where it must not be"))
    monkeypatch.setattr(linear, "prefill_dtype", lambda: torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(linear.apply_linear(layer, x, rowwise=False), layer(x))
    monkeypatch.setattr(linear, "prefill_dtype", lambda: torch.float32)
    out = linear.apply_linear(layer, x.requires_grad_(), rowwise=False)  # autograd would save the buffer
    out.float().sum().backward()
    assert x.grad is not None


def test_the_buffer_serves_calls_inside_and_outside_inference_mode(monkeypatch):
    layer = _layer(False)
    x = torch.randn(20, 96, generator=torch.Generator().manual_seed(3)).bfloat16()
    monkeypatch.setattr(linear, "prefill_dtype", lambda: torch.float32)
    with torch.inference_mode():
        inside = linear.apply_linear(layer, x, rowwise=False)
    with torch.no_grad():
        outside = linear.apply_linear(layer, x, rowwise=False)
    with torch.inference_mode():
        again = linear.apply_linear(layer, x, rowwise=False)
    assert torch.equal(inside, outside) and torch.equal(again, outside)
