"""validate.py: TypeError for a wrong type, ValueError for a bad value, both naming it."""

import math

import numpy as np
import pytest

from decodekit.validate import check_int, check_n, check_range


def test_check_int():
    assert check_int("k", np.int64(3), 0) == 3 and type(check_int("k", np.int64(3), 0)) is int
    with pytest.raises(TypeError, match=r"^k must be an integer >= 0, got 1.5$"):
        check_int("k", 1.5, 0)
    with pytest.raises(TypeError, match="k must be an integer"):
        check_int("k", True, 0)
    with pytest.raises(ValueError, match=r"^k must be an integer >= 0 and <= 20, got 21$"):
        check_int("k", 21, 0, 20)
    with pytest.raises(ValueError, match=r"^n must be an integer >= 1, got 0$"):
        check_n(0)


def test_check_range():
    assert check_range("p", 1, 0.0, 1.0, low_open=True) == 1.0
    with pytest.raises(ValueError, match=r"^p must be in \(0, 1\], got 0.0$"):
        check_range("p", 0.0, 0.0, 1.0, low_open=True)
    with pytest.raises(ValueError, match="nan"):
        check_range("p", math.nan, 0.0)
    with pytest.raises(TypeError, match="p must be a number"):
        check_range("p", "0.5", 0.0)
