"""Weights on transparent huge pages (Linux): fewer TLB misses where a kernel reads them.

A decode step streams every weight once, and a prefill's GEMM reads each weight column tile
over all of K: at Llama-3.1-8B's widths a row of a float32 weight in the transposed layout is
16-112 KiB, so each step of the GEMM's panel lands on another 4 KiB page, and an int8 GEMV's four
interleaved 4 KiB rows are four pages. With 4 KiB pages those walks miss the TLB; with 2 MiB pages
one entry covers 512 of them. On a Zen 4 (no AMX, one thread) the int8 GEMV at 4,096 -> 4,096 read
14 GB/s from 4 KiB pages and 16.7 from huge ones, the AVX2 GEMM's weight packing ran 1.4x
faster, and a whole decode step at those widths 1.13x (float32) and 1.09x (int8) faster
(BENCHMARKS.md, "Huge pages and a packed GEMM panel").

PyTorch's CPU allocator advises huge pages only under THP_MEM_ALLOC_ENABLE=1, a process-wide
switch read once; decodekit instead places the tensors its kernels stream (the float32
transposed weights, half weights, quantised codes) in an anonymous mapping aligned to 2 MiB and
advised MADV_HUGEPAGE (`on_huge_pages`), and leaves everything else to the allocator. The
kernel grants huge pages where the system's policy
(/sys/kernel/mm/transparent_hugepage/enabled) is "always" or "madvise"; under "never", off
Linux, or with DECODEKIT_HUGE_PAGES=0, tensors stay where they are. Only the whole 2 MiB pages
inside a tensor are advised, so its tail stays on small pages and no memory is added.
"""

from __future__ import annotations

import mmap
import os
import sys
from functools import cache
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
POLICY = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def policy() -> str:
    """Why tensors do or do not go on huge pages here: the system's THP policy ("always",
    "madvise": they do), or what stops them."""
    if os.environ.get("DECODEKIT_HUGE_PAGES", "1") == "0":
        return "off (DECODEKIT_HUGE_PAGES=0)"
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return "not Linux"
    try:
        text = POLICY.read_text()
    except OSError:
        return f"unknown ({POLICY} unreadable)"
    chosen = text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()
    return chosen if chosen in ("always", "madvise") else f"{chosen} (the system's policy)"


@cache
def available() -> bool:
    """Whether tensors go on huge pages here (module docstring, `policy`)."""
    return policy() in ("always", "madvise")


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor `t` whose whole 2 MiB pages are advised MADV_HUGEPAGE;
    `t.contiguous()` for a tensor under 2 MiB, off the CPU, or where `available()` is false.
    The copy is an ordinary tensor that keeps its mapping alive."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < HUGE_PAGE or not available():
        return t.contiguous()
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    region.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    out = raw[start : start + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
