"""`bench packed --gguf FILE` (bench/gguf_files.py): the parts that need no llama.cpp build."""

from __future__ import annotations

import pytest

pytest.importorskip("gguf")

from decodekit.bench import llamacpp  # noqa: E402
from decodekit.bench.gguf_files import bench_gguf, greedy_agreement  # noqa: E402
from decodekit.cli import main  # noqa: E402
from decodekit.compress.gguf import write_gguf  # noqa: E402
from decodekit.models.registry import ASSETS  # noqa: E402


def test_greedy_agreement_counts_tokens_before_the_first_difference():
    ours = [[1, 2, 3, 4], [5, 6, 7, 8]]
    theirs = [[1, 2, 9, 4], [5, 6, 7, 8]]
    assert greedy_agreement(ours, theirs) == {
        "tokens_before_first_difference": 0.75,  # 2 + 4 of 8
        "positions_equal": 0.875,  # position 3 of the first differs, position 4 agrees again
        "continuations_equal": [False, True],
    }


def test_bench_times_the_file_and_reports_the_peer_absent(tmp_path, monkeypatch, one_thread):
    path = write_gguf(ASSETS / "shakespeare", tmp_path / "s-q8_0.gguf", "q8_0")
    monkeypatch.setattr(llamacpp, "peer_directories", lambda: [tmp_path])
    report = bench_gguf([str(path)], new_tokens=2, repeats=1, prefill_tokens=16, peer="llamacpp")
    [row] = report["files"]
    assert row["file"] == "s-q8_0.gguf" and row["kernels"] and row["decodekit"]["decode_tok_s"] > 0
    assert "llama.cpp" not in row and report["peer"]["llamacpp"]["available"] is False


def test_gguf_is_a_bench_packed_flag(capsys):
    assert main(["bench", "decode", "--gguf", "x.gguf"]) == 2
    assert "--gguf applies to bench packed, not bench decode" in capsys.readouterr().err
