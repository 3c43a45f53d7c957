import pytest

from decodekit.bench.packed import bench_packed, random_model


@pytest.mark.usefixtures("torch_kernels_only")  # names PyTorch's kernels
def test_bench_rows_kernels_and_self_draft(tiny_llama_dir, one_thread):
    report = bench_packed(str(tiny_llama_dir), new_tokens=4, repeats=1, prefill_tokens=32,
                          calib_windows=2, calib_length=32, perplexity=False)  # fmt: skip
    rows = {row["config"]: row for row in report["rows"]}
    assert list(rows) == ["float32", "bfloat16", "int8 RTN", "int8 GPTQ", "int4 GPTQ"]
    assert rows["float32"]["decode_vs_f32"] == 1.0
    assert rows["int8 RTN"]["kernels"] == rows["int8 GPTQ"]["kernels"] == {"int8pack": 8}
    assert rows["int4 GPTQ"]["kernels"] == {"int4pack": 8}
    assert all(row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0 for row in rows.values())
    speculative = report["speculative_t0"]  # exact at T = 0: bench_packed asserts it
    assert set(speculative) == {"plain_f32_tok_s", "gamma", "self-int4 (RTN g32)", "self int4 GPTQ"}
    assert 0 <= speculative["self-int4 (RTN g32)"]["acceptance_rate"] <= 1


def test_unknown_shape_names_the_choices():
    with pytest.raises(ValueError, match=r"shape must be one of 'smollm2-135m', .*, got 'gpt5'"):
        random_model("gpt5")
