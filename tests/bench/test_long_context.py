"""`bench speculative --clients N --prompt-tokens P` (issue 36, bench/long_context.py): prompts of
exactly P tokens, the engine that keeps their KV, and the RoPE-scaled copy of a checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from decodekit.bench.long_context import (
    check_context,
    context_engine_config,
    context_prompts,
    rope_scaled_copy,
)
from decodekit.models.registry import embedded_models


@pytest.fixture(scope="module")
def pair():
    if not {"shakespeare", "shakespeare-draft"} <= set(embedded_models()):
        pytest.skip("the embedded shakespeare pair is not built")
    import decodekit as dk

    return dk.load_model("shakespeare"), dk.load_model("shakespeare-draft")


def test_context_prompts_are_distinct_windows_of_exactly_the_length(pair):
    target, _ = pair
    prompts = context_prompts(target, 5, 300)
    assert [len(p) for p in prompts] == [300] * 5
    assert len({tuple(p[:16]) for p in prompts}) == 5  # no two share a first prefix-cache block
    with pytest.raises(ValueError, match="prompt_tokens must be at most"):
        context_prompts(target, 1, 10**7)


def test_check_context_names_the_sum_and_the_model(pair):
    check_context(pair, 400, 100, 4)  # 504 <= 512
    with pytest.raises(ValueError, match=r"400 \+ 110 \+ 4 = 514 is past shakespeare"):
        check_context(pair, 400, 110, 4)


def test_engine_config_holds_every_sequence():
    config = context_engine_config(16, 2068)
    assert config.num_blocks >= 16 * (2068 // 16 + 1) and config.max_running >= 16
    assert config.compile is False


def test_bench_with_prompt_tokens_runs_the_long_workload_only(pair):
    from decodekit.bench.speculative import bench_concurrent

    out = bench_concurrent(concurrent=2, new_tokens=4, repeats=1, single_prompts=1, prompt_tokens=300)
    assert out["prompt_tokens"] == 300
    assert out["plain"]["engine_steps"] == 4
    # every timed plain admission (2 batched, 1 alone) found its prompt's 18 full blocks cached
    assert out["prefix_cache_hit_tokens"] >= 3 * (300 // 16 * 16)
    for key in ("gamma4", "gamma4_always", "gamma4_adaptive", "gamma1_always"):
        assert out[key]["speedup_cpu"] > 0 and out[key]["block_efficiency"] >= 1
    assert "copy_plain" not in out and "copy_lookup_gamma4" not in out
    with pytest.raises(ValueError, match="past shakespeare's context of 512 positions"):
        bench_concurrent(concurrent=1, new_tokens=16, repeats=1, single_prompts=1, prompt_tokens=500)


def test_rope_scaled_copy_changes_only_the_base_and_the_context(pair, tmp_path):
    import decodekit as dk
    from decodekit.models.registry import resolve

    _, original = pair
    source = resolve("shakespeare-draft")[1] / "config.json"
    before = source.read_text()
    path = rope_scaled_copy("shakespeare-draft", tmp_path, 16.0, 2304)
    assert source.read_text() == before  # the shipped checkpoint is untouched
    config = json.loads((path / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 160000.0}
    scaled = dk.load_model(path)
    assert scaled.max_context == 2304 and original.max_context == 512
    ids = torch.tensor([[5]])  # position 0 is not rotated: the same weights give the same logits
    with torch.inference_mode():
        same = [m.forward(ids, m.new_cache(1)) for m in (original, scaled)]
        ids = torch.tensor([[5, 6, 7]])
        moved = [m.forward(ids, m.new_cache(1)) for m in (original, scaled)]
    assert torch.equal(same[0], same[1])
    assert not torch.allclose(moved[0][0, -1], moved[1][0, -1])  # later positions rotate by the new base
    with pytest.raises(ValueError, match="already scales its RoPE"):
        rope_scaled_copy(_linear(tmp_path), tmp_path)


def _linear(tmp_path):
    from decodekit.models.registry import resolve

    source = resolve("shakespeare-draft")[1]
    out = tmp_path / "linear"
    out.mkdir()
    config = json.loads((source / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    (out / "config.json").write_text(json.dumps(config))
    return out
