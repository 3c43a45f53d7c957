"""Streamed weights on transparent huge pages (models/hugepages.py): the same values, 2 MiB
aligned and advised where the system allows it, left alone where it does not; a loaded
model's float32, half and quantised weights are placed so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import decodekit as dk
from decodekit.compress.recipe import CompressConfig, quantized_copy
from decodekit.models import hugepages
from decodekit.models.half_linear import keep_half_weights
from decodekit.models.hugepages import HUGE_PAGE, on_huge_pages
from decodekit.models.shapes import random_model

needs_huge_pages = pytest.mark.skipif(not hugepages.available(), reason="no transparent huge pages here")


def eligible(t: torch.Tensor) -> bool:
    """/proc/self/smaps: whether the mapping holding t's data may take huge pages."""
    address, inside = t.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(part, 16) for part in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds address {address:#x}")


@needs_huge_pages
def test_a_copy_on_huge_pages_has_the_values_and_is_advised():
    t = torch.randn(1536, 1024)  # 6 MiB: 3 whole huge pages
    placed = on_huge_pages(t.t())
    assert placed.is_contiguous() and placed.shape == (1024, 1536)
    assert torch.equal(placed, t.t())
    assert placed.data_ptr() % HUGE_PAGE == 0
    assert eligible(placed)
    del t
    assert torch.equal(placed.t().t(), placed)  # the copy owns its memory
    placed.add_(1)  # and is writable


def test_small_tensors_and_a_switched_off_system_stay_put(monkeypatch):
    small = torch.randn(100, 100).t()
    out = on_huge_pages(small)
    assert out.is_contiguous() and torch.equal(out, small)
    monkeypatch.setenv("DECODEKIT_HUGE_PAGES", "0")
    hugepages.available.cache_clear()
    try:
        assert not hugepages.available()
        big = torch.randn(1024, 1024)
        assert on_huge_pages(big) is big  # contiguous already: itself
    finally:
        monkeypatch.undo()
        hugepages.available.cache_clear()


@needs_huge_pages
def test_a_loaded_models_streamed_weights_are_on_huge_pages():
    model = dk.load_model("shakespeare-large")  # 2-5.4 MiB layers, and the tied head
    large = [(n, p) for n, p in model.net.named_parameters() if p.numel() * p.element_size() >= HUGE_PAGE]
    assert len(large) >= 3 * model.config.num_layers
    for name, p in large:
        assert p.data_ptr() % HUGE_PAGE == 0 and eligible(p), name
    keep_half_weights(model.net, torch.bfloat16)
    halves = [p for p in model.net.parameters() if p.dtype == torch.bfloat16 and p.numel() * 2 >= HUGE_PAGE]
    assert halves and all(p.data_ptr() % HUGE_PAGE == 0 and eligible(p) for p in halves)


@needs_huge_pages
@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantised_models_codes_are_on_huge_pages(bits):
    model = random_model("qwen2.5-0.5b", layers=1)  # int8 gate/up 8.3 MiB, int4 4.2 MiB
    twin = quantized_copy(model, CompressConfig(method="rtn", bits=bits))
    streamed = [b for n, b in twin.net.named_buffers()
                if n.endswith(("kernel_weight", "qweight")) and b.numel() >= HUGE_PAGE]  # fmt: skip
    assert streamed
    assert all(b.data_ptr() % HUGE_PAGE == 0 and eligible(b) for b in streamed)
