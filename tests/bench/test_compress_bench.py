import pytest

from decodekit.bench.compress import bench_compress, table
from decodekit.compress.recipe import CompressConfig
from decodekit.models import kernels

TEXT = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet. " * 6


def test_bench_rows_and_table(tiny_llama_dir, one_thread, capsys, monkeypatch):
    monkeypatch.setattr("decodekit.runtime.PROGRESS_INTERVAL", 0.0)  # off a terminal: a line at the end
    configs = (None, CompressConfig("rtn", bits=8), CompressConfig("magnitude", n_m="2:4"))
    report = bench_compress(str(tiny_llama_dir), new_tokens=4, repeats=1, configs=configs,
                            progress=True, text=TEXT)  # fmt: skip
    fp32, int8, sparse = report["rows"]
    # progress over the three configurations and then the decode timings
    assert "bench compress: 4/4 (100%)" in capsys.readouterr().err
    assert [r["config"] for r in report["rows"]] == ["fp32", "rtn-8b", "magnitude-2:4"]
    assert fp32["ppl_change_pct"] == 0.0 and fp32["memory_ratio"] == 1.0
    # 2 blocks x (9216 weights x 3 bytes saved - 256 scales x 4 bytes): test_pretrained.py,
    # less PyTorch's int8pack kernel's bfloat16 copy of the scales (2 bytes per row) where
    # decodekit's own int8gemv (models/kernels.py), which reads the stored scales, is not built.
    copy = 0 if kernels.available() else 256 * 2
    assert fp32["memory_bytes"] - int8["memory_bytes"] == 2 * (9216 * 3 - 256 * 4 - copy)
    assert sparse["memory_bytes"] == fp32["memory_bytes"]  # zeros are stored densely
    assert int8["disk_bytes"] < fp32["disk_bytes"] and int8["layers"] == 8
    assert all(r["decode_tok_s"] > 0 and r["tokens"] == fp32["tokens"] for r in report["rows"])
    assert fp32["kl_fp32"] == pytest.approx(0.0, abs=1e-6)  # the same weights, saved and loaded
    assert sparse["kl_fp32"] > int8["kl_fp32"] > 0
    lines = table(report).splitlines()
    assert lines[2].startswith("| config | perplexity") and len(lines) == 4 + 3
    assert lines[5].startswith("| rtn-8b | ")
