import pytest
import torch

from decodekit.bench.packed import bench_packed, median_seconds, random_model


@pytest.mark.usefixtures("torch_kernels_only")  # names PyTorch's kernels
def test_bench_rows_kernels_and_self_draft(tiny_llama_dir, one_thread):
    report = bench_packed(str(tiny_llama_dir), new_tokens=4, repeats=1, prefill_tokens=32,
                          calib_windows=2, calib_length=32, perplexity=False)  # fmt: skip
    rows = {row["config"]: row for row in report["rows"]}
    assert list(rows) == ["float32", "bfloat16", "int8 RTN", "int8 RTN g64", "int8 RTN g128", "int8 GPTQ",
                          "int4 GPTQ", "int8 RTN a8", "int8 RTN g32 a8", "int4 GPTQ a8"]  # fmt: skip
    assert rows["float32"]["decode_vs_f32"] == 1.0
    assert rows["int8 RTN"]["kernels"] == rows["int8 GPTQ"]["kernels"] == {"int8pack": 8}
    # tiny_llama's widths are 32 and 64: groups of 64 fit only the down projections' input, 128 none.
    assert rows["int8 RTN g64"]["kernels"] == {"unpack": 2}
    assert rows["int8 RTN g128"] == {"config": "int8 RTN g128",
                                     "skipped": "no layer's input width is a multiple of 128"}  # fmt: skip
    auto = rows["bfloat16"]["auto_loads_a_bf16_checkpoint_as"]
    assert auto in ("float32", "bfloat16") and report["dtype_auto"] == {"bfloat16_checkpoint": auto}
    assert report["clock"] == "process CPU time" and "wall_decode_tok_s" in rows["int4 GPTQ"]
    assert rows["int4 GPTQ"]["kernels"] == {"int4pack": 8}
    # Without decodekit's kernels an activation-quantised layer unpacks (PyTorch's are weight-only).
    assert rows["int8 RTN a8"]["kernels"] == rows["int4 GPTQ a8"]["kernels"] == {"unpack": 8}
    timed = [row for row in rows.values() if "skipped" not in row]
    assert len(timed) == 9 and all(row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0 for row in timed)
    speculative = report["speculative_t0"]  # exact at T = 0: bench_packed asserts it
    assert set(speculative) == {"plain_f32_tok_s", "gamma", "self-int4 (RTN g32)", "self int4 GPTQ"}
    assert 0 <= speculative["self-int4 (RTN g32)"]["acceptance_rate"] <= 1


def test_unknown_shape_names_the_choices():
    with pytest.raises(ValueError, match=r"shape must be one of 'smollm2-135m', .*, got 'gpt5'"):
        random_model("gpt5")


def test_rounds_interleave_every_timer():
    calls = []

    def timer(name):
        return lambda: calls.append(name) or (1.0 if name == "a" else 2.0, 3.0)

    seconds = median_seconds({"a": timer("a"), "b": timer("b")}, repeats=3)
    assert calls == ["a", "b"] * 4  # a warm-up round, then three interleaved ones
    assert seconds == {"a": (1.0, 3.0), "b": (2.0, 3.0)}


def test_two_threads_use_the_wall_clock_and_restore_the_threads(tiny_llama_dir, one_thread, monkeypatch):
    from decodekit.bench import packed

    # one quantised row, the one the speculative comparison drafts with: two threads on a
    # tiny model's ops cost 20x one on a busy 2-core machine (the whole bench took 65 s)
    monkeypatch.setattr(packed, "QUANT_ROWS", {"int4 GPTQ": packed.QUANT_ROWS["int4 GPTQ"]})
    report = bench_packed(str(tiny_llama_dir), new_tokens=2, repeats=1, prefill_tokens=16, calib_windows=1,
                          calib_length=16, perplexity=False, threads=2)  # fmt: skip
    assert report["threads"] == 2 and report["clock"] == "wall"
    assert "wall_decode_tok_s" not in report["rows"][0] and torch.get_num_threads() == 1
