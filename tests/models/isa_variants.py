"""The kernels pick their instruction set once per process (DECODEKIT_GEMV_ISA forces one):
`same_bits_per_isa` runs a script in one child process per variant and checks that the
AVX-512 and AVX2 variants return the same bits."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def same_bits_per_isa(script: str, tmp_path, missing: tuple[str, ...] = ("AssertionError: avx2",)) -> None:
    """`script` saves a list of tensors to argv[1] and asserts that argv[2] is the variant in
    use; skips when the AVX-512 child's stderr shows one of `missing` (a CPU without it)."""
    results = {}
    for isa in ("avx512", "avx2"):
        env = {**os.environ, "DECODEKIT_GEMV_ISA": isa}
        path = tmp_path / f"{isa}.pt"
        done = subprocess.run([sys.executable, "-c", script, str(path), isa], env=env,
                              capture_output=True, text=True)  # fmt: skip
        if isa == "avx512" and any(marker in done.stderr for marker in missing):
            pytest.skip(f"this CPU lacks the AVX-512 variant's instructions ({done.stderr.strip()[-80:]})")
        assert done.returncode == 0, done.stderr[-2000:]
        results[isa] = torch.load(path)
    for wide, narrow in zip(results["avx512"], results["avx2"], strict=True):
        assert torch.equal(wide, narrow)


def on_one_and_two_threads(layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """layer(x) with one torch thread and with two (the kernels split work between threads;
    each output must still be one thread's fixed sequence of operations), the setting restored."""
    before = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(1)
            one = layer(x)
            torch.set_num_threads(2)
            two = layer(x)
    finally:
        torch.set_num_threads(before)
    return one, two
