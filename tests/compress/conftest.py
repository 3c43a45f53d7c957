"""Shared fixtures: random layers with correlated calibration inputs (X = Z Aᵀ)."""

import pytest
import torch


def _correlated_problem(seed: int, out_features: int, in_features: int, samples: int = 1024):
    """Weight [N, K] and inputs X [n, K] whose features are mixed by a random A [K, K]."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g)
    mixing = torch.randn(in_features, in_features, generator=g)
    z = torch.randn(samples, in_features, generator=g)
    return weight, z @ mixing.T


def _output_error(weight: torch.Tensor, approx: torch.Tensor, x: torch.Tensor) -> float:
    """||W X - Ŵ X|| with X given as rows [n, K]."""
    return ((weight - approx) @ x.T).norm().item()


@pytest.fixture
def correlated_problem():
    return _correlated_problem


@pytest.fixture
def output_error():
    return _output_error


@pytest.fixture(autouse=True)
def _one_thread():
    # The CPU is shared; these tests are small enough for one core.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
