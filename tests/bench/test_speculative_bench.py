"""`bench speculative --concurrent`: a tiny run has every figure, and its speculative output
equals plain greedy output (the benchmark asserts it on every run)."""

from __future__ import annotations

import pytest


def test_concurrent_bench_reports_both_sides():
    from decodekit.bench.speculative import bench_concurrent
    from decodekit.models.registry import embedded_models

    if not {"shakespeare", "shakespeare-draft"} <= set(embedded_models()):
        pytest.skip("the embedded shakespeare pair is not built")
    out = bench_concurrent(concurrent=2, new_tokens=4, repeats=1, single_prompts=1)
    assert out["plain"]["engine_steps"] == 4  # one token per step for every request at once
    for key in ("gamma4", "gamma4_always", "gamma4_adaptive", "gamma1_always", "copy_lookup_gamma4",
                "copy_lookup_gamma4_always"):
        row = out[key]
        assert row["tok_s"] > 0 and row["speedup_cpu"] > 0 and row["block_efficiency"] >= 1
        assert 1 < row["engine_steps"] <= 5  # a prefill step, then rounds of >= 1 token each
    assert out["gamma4_always"]["plain_steps"] == 0 < out["gamma4"]["plain_steps"]  # the gate's first step
    for key in ("gamma4", "gamma4_always", "copy_lookup_gamma4"):
        assert out["single"][key]["speedup"] > 0
    assert out["machine"]["threads"] == 1
