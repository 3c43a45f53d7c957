"""`bench latency` (seed 000's latency table) and `bench presets` on tiny models: the grid, the
cache left as it was, the table and plot, and the errors."""

from __future__ import annotations

import pytest

from decodekit.bench.latency import bench_latency, filled_cache, plot, table, time_forward
from decodekit.models.registry import load_model


def test_grid_table_and_plot(tiny_llama_dir, one_thread, tmp_path):
    result = bench_latency(str(tiny_llama_dir), batch_sizes=(1, 3), new_tokens=(1, 2, 5), context=20,
                           repeats=1)
    cells = result["cells"]
    assert [(c["batch_size"], c["new_tokens"]) for c in cells] == [(b, t) for b in (1, 3) for t in (1, 2, 5)]
    assert cells[0]["ratio"] == 1.0 and all(c["cpu_ms"] > 0 and c["wall_ms"] > 0 for c in cells)
    assert cells[-1]["ratio"] == pytest.approx(cells[-1]["cpu_ms"] / cells[0]["cpu_ms"], rel=0.01)
    lines = table(result).splitlines()
    assert lines[2] == "| batch \\ new tokens | 1 | 2 | 5 |" and lines[5].startswith("| 3 | ")
    pytest.importorskip("matplotlib")
    plot(result, str(tmp_path / "latency.png"))
    assert (tmp_path / "latency.png").stat().st_size > 1000


def test_the_timed_forward_leaves_the_cache_at_its_context(tiny_lm):
    cache = filled_cache(tiny_lm, batch_size=2, context=30, room=4)
    keys = cache.keys[:, :, :, :30].clone()
    assert cache.length == 30 and bool(cache.mask.all())
    time_forward(tiny_lm, cache, num_tokens=4, repeats=2)
    assert cache.length == 30 and int(cache.next_position[0]) == 30
    assert bool((cache.keys[:, :, :, :30] == keys).all())  # the context was not overwritten


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"context": 90}, "context 90 \\+ 16 new tokens is past model .* context of 96 positions"),
    ({"batch_sizes": ()}, "batch sizes must be a non-empty list"),
    ({"new_tokens": (0,)}, "new tokens must be an integer >= 1, got 0"),
    ({"repeats": 0}, "repeats must be an integer >= 1, got 0"),
])
def test_bad_values(tiny_llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        bench_latency(str(tiny_llama_dir), **kwargs)


def test_models_without_a_dense_cache_are_refused():
    with pytest.raises(ValueError, match="times NativeLM's dense cache"):
        filled_cache(load_model("shakespeare-5gram"), 1, 8, 1)


def test_cli(tiny_llama_dir, capsys):
    import json

    from decodekit.cli import main

    assert main(["bench", "latency", "--model", str(tiny_llama_dir), "--batch-sizes", "1,2", "--tokens", "1",
                 "--context", "8", "--repeats", "1", "--json"]) == 0
    assert [c["batch_size"] for c in json.loads(capsys.readouterr().out)["cells"]] == [1, 2]
    assert main(["bench", "latency", "--batch-sizes", "1,x"]) == 2
    assert "--batch-sizes must be comma-separated positive integers, got '1,x'" in capsys.readouterr().err
    assert main(["bench", "presets", "--plot", "p.png"]) == 2
    assert "--plot applies to bench latency, not bench presets" in capsys.readouterr().err


def test_bench_presets_rows(tiny_llama_dir, one_thread):
    from decodekit.bench.presets import bench_presets
    from decodekit.bench.presets import table as presets_table
    from decodekit.params import PRESETS

    result = bench_presets(str(tiny_llama_dir), str(tiny_llama_dir), prompts=2, samples=2, new_tokens=4)
    rows = {r["config"]: r for r in result["rows"]}
    assert list(rows) == ["plain (T 1, top-p 1)", "greedy", *PRESETS]
    assert all((rows[n]["temperature"], rows[n]["top_p"]) == PRESETS[n] for n in PRESETS)
    assert all(0 < r["distinct_2"] <= 1 and r["expert_loglik_per_token"] < 0 for r in rows.values())
    # the same judge as the expert scores the same; the same parameters and seed draw the same
    assert all(r["judge_loglik_per_token"] == r["expert_loglik_per_token"] for r in rows.values())
    same = ("code-generation", "data-analysis")  # both T 0.2, top-p 0.1 in seed 003
    assert {k: v for k, v in rows[same[0]].items() if k != "config"} == \
        {k: v for k, v in rows[same[1]].items() if k != "config"}
    assert len(presets_table(result).splitlines()) == 2 + len(rows)
