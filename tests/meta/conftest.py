"""Fixtures of the meta-generation tests (helpers in meta_toys.py)."""

from __future__ import annotations

import pytest
import torch
from meta_toys import make_toy_model


@pytest.fixture(scope="session")
def toy_model():
    return make_toy_model()


@pytest.fixture
def one_thread():
    """Tiny tensors: torch's thread pool costs more than it saves on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
