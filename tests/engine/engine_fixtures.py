"""A tiny NativeLM with sharp next-token distributions for the engine tests.

The random init of tests/conftest.py gives near-uniform distributions, where float
noise between a batched and an unbatched matmul could flip a greedy choice; weights
re-drawn with std 0.15 (as tests/models/test_native.py) make the argmax robust, so the
tests can demand token-for-token equality.
"""

from __future__ import annotations

import pytest
import torch

from decodekit.models.native import NativeLM


@pytest.fixture(scope="session")
def sharp_lm(tiny_llama_dir) -> NativeLM:
    model = NativeLM.from_pretrained(tiny_llama_dir)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.net.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.15 * noise)
    return model


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny models gain nothing from threads, and the test machine's cores are shared.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
