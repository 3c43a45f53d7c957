"""Scratch buffers: large CPU work tensors a thread reuses from call to call.

A fresh tensor of tens of megabytes is page-faulted in at every call (glibc maps such blocks
on their own and unmaps them when freed): a prefill's widened weight (models/kernels.py
`scratch`: 4.6 ms to allocate and fill 17 MB against 1.1 ms to refill, Zen 3), a decode step's
float64 probabilities and log-softmax at a real vocabulary (sampling/select.py: 75,974 page
faults a step at 64 rows of 151,936 tokens). `scratch` keeps one buffer per thread, dtype and
`slot` (each caller names its own, so two uses alive at once never share one), grown to the
largest request, and hands out a view of it: valid until the same slot's next use in the
same thread, so callers read it at once and copy what they keep. `worth_scratch` says where
buffers pay: large work on the CPU (small blocks glibc keeps anyway; a GPU's caching
allocator keeps its temporaries).
"""

from __future__ import annotations

import math
import threading

import torch

_BUFFERS = threading.local()
# Work below this stays in plain ops (a few calls fewer; glibc keeps small blocks).
MIN_BYTES = 4 * 2**20


def worth_scratch(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether work of `tensor`'s shape in `dtype` takes scratch buffers (module docstring)."""
    return tensor.is_cpu and tensor.numel() * dtype.itemsize >= MIN_BYTES


def scratch(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, slot: str) -> torch.Tensor:
    """A CPU tensor of `shape` from this thread's buffer `slot` of `dtype`; its contents are
    garbage (module docstring)."""
    numel = math.prod(shape)
    buffers = _BUFFERS.__dict__.setdefault("buffers", {})
    # A normal tensor, not an inference one: a call under torch.inference_mode and a later one
    # outside it both write into it.
    with torch.inference_mode(False):
        buffer = buffers.get((dtype, slot))
        if buffer is None or buffer.numel() < numel:
            buffer = buffers[(dtype, slot)] = torch.empty(numel, dtype=dtype, device="cpu")
        return buffer[:numel].view(shape)
