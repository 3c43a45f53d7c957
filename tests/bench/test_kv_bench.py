"""`bench kv`: its table and its flag errors (the measurement itself is minutes: BENCHMARKS.md;
the cache it measures through is tested in tests/models/test_kv_compression.py)."""

from __future__ import annotations

from decodekit.bench.kv_compression import table


def test_table_rows():
    dtype = {"perplexity": 36.29, "formula_bytes_per_token": 1024, "pool_bytes_per_token": 1088.0,
             "pool_ratio_to_float32": 3.76, "running_rows_bytes": 1, "cpu_tok_s": 2000.0,
             "speed_vs_float32": 0.9}  # fmt: skip
    drop = {"kept": 0.25, "budget": 128, "sinks_recent": 36.46, "recent_only": 36.45, "h2o": 36.51,
            "kv_bytes_per_sequence": 524288}  # fmt: skip
    result = {"model": "m", "window": 512, "stride": 256, "kv_dtypes": {"int8": dtype}, "dropping": [drop],
              "sinks": 4}  # fmt: skip
    lines = table(result).splitlines()
    assert lines[2].split() == ["int8", "36.290", "1024", "1088", "3.76", "2000.0", "0.900"]
    assert lines[4].split() == ["25.0%", "128", "36.460", "36.450", "36.510", "524288"]


def test_cli_errors(capsys):
    from decodekit.cli import main

    assert main(["bench", "kv", "--dtype", "bfloat16"]) == 2
    assert "--dtype applies to bench decode, engine and latency, not bench kv" in capsys.readouterr().err
