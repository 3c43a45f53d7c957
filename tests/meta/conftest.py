"""Fixtures of the meta-generation tests (helpers in meta_toys.py)."""

from __future__ import annotations

import pytest
from meta_toys import make_toy_model


@pytest.fixture(scope="session")
def toy_model():
    return make_toy_model()
