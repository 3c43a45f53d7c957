"""bench dtype (bench/dtype.py): compressed rows beside the dtypes, and the fraction of peak."""

from __future__ import annotations

import pytest
import torch

from decodekit.bench.dtype import bench_dtype, gemm_peak_gflops

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_compressed_rows_and_fraction_of_peak():
    result = bench_dtype("shakespeare-draft", ("float32", "int8-rtn"), new_tokens=2, prompt_tokens=16,
                         batches=(2,), batch_new_tokens=2, repeats=1)  # fmt: skip
    rows = result["results"]
    assert set(rows) == {"float32", "int8-rtn", "hf_float32"}
    peaks = result["gemm_peak_gflops"]
    assert peaks["float32"] > 0 and peaks["bfloat16"] > 0
    for name, row in rows.items():
        batch = row["batch2"]
        peak = peaks["float32" if name != "int8-rtn" else "bfloat16"]
        assert batch["gflops"] > 0
        # One measurement, rounded twice: gflops to 0.1 and fraction_of_peak to 0.001 (the
        # peak as reported). Read back from the rounded gflops, the fraction is off by at most
        # the two roundings, 0.05 / peak + 0.0005, at any load; a fixed 2e-3 failed wherever a
        # loaded machine's peak was near 1 GFLOP/s (1.188 against 1.2 / 1.0).
        assert abs(batch["fraction_of_peak"] - batch["gflops"] / peak) <= 0.05 / peak + 0.0005 + 1e-9
    assert set(result["ratio_to_float32_cpu_time"]) == {"int8-rtn", "hf_float32"}


def test_a_compressed_row_needs_the_float32_row_first():
    message = "'int4-gptq' is a compressed copy of the float32 model: list float32 first"
    with pytest.raises(ValueError, match=message):
        bench_dtype("shakespeare-draft", ("int4-gptq",), new_tokens=1, batches=(), repeats=1)


def test_gemm_peak_counts_the_flops_of_one_matmul():
    assert 0.1 < gemm_peak_gflops(64, 128, torch.float32, repeats=1) < 1e5
