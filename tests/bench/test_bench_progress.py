"""Issue 35: a benchmark's progress moves within a timing, run by run, not only when a whole
figure (a warm-up and `repeats` runs of it) is done."""

from __future__ import annotations

import pytest

from decodekit.bench.constrained import paired_seconds
from decodekit.bench.decode import _median_seconds
from decodekit.bench.dtype import _median
from decodekit.bench.engine import compare
from decodekit.bench.packed import median_seconds
from decodekit.runtime import ProgressLines, within_unit


def counting():
    calls = []
    return calls, lambda: calls.append(1)


@pytest.mark.parametrize("timing", [
    lambda fn, on_progress: _median_seconds(fn, 3, on_progress),
    lambda fn, on_progress: _median(fn, 3, on_progress),
    lambda fn, on_progress: paired_seconds(fn, fn, 3, on_progress),
    lambda fn, on_progress: compare(fn, fn, 3, on_progress),
], ids=["bench decode", "bench dtype", "bench constrained", "bench engine"])
def test_a_timing_reports_after_its_warm_up_and_each_run(timing):
    calls, fn = counting()
    shares = []
    timing(fn, lambda share: shares.append((share, len(calls))))
    per_round = len(calls) // 4  # one function, or two run alternately
    assert shares == [(0.25, per_round), (0.5, 2 * per_round), (0.75, 3 * per_round), (1.0, 4 * per_round)]


def test_interleaved_timers_report_after_every_run():
    shares = []
    median_seconds({"a": lambda: (1.0, 1.0), "b": lambda: (2.0, 2.0)}, 3, shares.append)
    assert shares == [i / 8 for i in range(1, 9)]  # 2 timers x (a warm-up and 3 runs)


def test_within_unit_moves_the_bar_inside_the_next_unit_and_ends_it():
    bar = ProgressLines(total=3, interval=60)
    bar.update()
    step = within_unit(bar)
    step(0.5)
    assert bar.n == 1.5
    step(1.0)
    step(2.0)  # a share past the whole stays at the unit's end
    assert bar.n == 2
    within_unit(bar)(0.25)
    assert bar.n == 2.25
    bar.close()
