"""llama.cpp as a named peer (bench/llamacpp.py, bench/gguf.py): the parts that need no
build run everywhere; the `peer` tests run against the build scripts/peers.sh makes and
skip without it."""

from __future__ import annotations

import json
import stat

import pytest

from decodekit.bench import llamacpp
from decodekit.bench.gguf import gpt2_pre_tokenizer
from decodekit.bench.llamacpp import ABSENT, find_llamacpp, repack_pattern
from decodekit.bench.packed import bench_packed
from decodekit.models.registry import ASSETS


def test_only_gpt2s_byte_level_split_is_registered_as_gpt2():
    shipped = json.loads((ASSETS / "shakespeare" / "tokenizer.json").read_text())
    assert gpt2_pre_tokenizer(shipped)  # what `shakespeare` and the random shapes use
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
    assert gpt2_pre_tokenizer({"pre_tokenizer": byte_level})  # use_regex defaults to true
    assert not gpt2_pre_tokenizer({"pre_tokenizer": {**byte_level, "use_regex": False}})
    assert not gpt2_pre_tokenizer({"pre_tokenizer": {"type": "Metaspace", "replacement": "▁"}})
    assert not gpt2_pre_tokenizer({"pre_tokenizer": None})
    assert not gpt2_pre_tokenizer({})


def fake_python(directory, exit_code: int):
    """A peers directory whose venv 'python' exits with `exit_code` (0: imports succeed)."""
    python = directory / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\nexit {exit_code}\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return directory


def test_the_first_directory_whose_python_imports_llama_cpp_is_the_peer(tmp_path, monkeypatch):
    broken, working = fake_python(tmp_path / "broken", 1), fake_python(tmp_path / "working", 0)
    monkeypatch.setattr(llamacpp, "peer_directories", lambda: [tmp_path / "missing", broken, working])
    assert find_llamacpp().directory == working
    monkeypatch.setattr(llamacpp, "peer_directories", lambda: [tmp_path / "missing", broken])
    assert find_llamacpp() is None


def test_peers_directory_comes_from_the_environment_first(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEKIT_PEERS", str(tmp_path))
    monkeypatch.chdir(tmp_path.parent)
    assert llamacpp.peer_directories()[:2] == [tmp_path, tmp_path.parent / ".peers"]


def test_bench_reports_the_peer_absent_without_failing(tiny_llama_dir, one_thread, tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp, "peer_directories", lambda: [tmp_path])
    report = bench_packed(str(tiny_llama_dir), new_tokens=2, repeats=1, prefill_tokens=16, calib_windows=1,
                          calib_length=16, perplexity=False, peer="llamacpp")  # fmt: skip
    assert report["peer"] == {"llamacpp": {"available": False, "reason": ABSENT}}
    assert [row["config"] for row in report["rows"]][0] == "float32"  # its own rows are unchanged


def test_unknown_peer_names_the_choice():
    with pytest.raises(ValueError, match="peer must be None or 'llamacpp', got 'vllm'"):
        bench_packed("shakespeare", peer="vllm")


def test_repacking_takes_only_the_weights_llama_cpp_stores_as_q4_0():
    from decodekit.models.registry import load_model
    from decodekit.models.shapes import random_model

    # shakespeare's MLP is 688 wide: not a multiple of q4_0's 32-weight blocks, so its
    # down projection falls back to f16 in llama.cpp's q4_0 file and must not be repacked.
    small = repack_pattern(load_model("shakespeare", backend="native").config)
    assert small == r"^blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up)\.weight$"
    qwen = repack_pattern(random_model("qwen2.5-0.5b-16l", layers=1).config)
    assert "ffn_down" in qwen and "attn_output" in qwen


PEER = find_llamacpp()


@pytest.mark.peer
@pytest.mark.skipif(PEER is None, reason="no llama-cpp-python build: bash scripts/peers.sh")
def test_llama_cpp_greedy_equals_decodekit_greedy_on_shakespeare(one_thread, tmp_path):
    import decodekit as dk
    from decodekit.models.registry import load_model

    model = load_model("shakespeare", backend="native")
    paths = llamacpp.ggufs(PEER, "shakespeare", tmp_path)
    prompts = [model.encode(text) for text in llamacpp.GREEDY_PROMPTS]
    params = dk.SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    ours = [list(c[0].token_ids) for c in dk.generate(model, prompts, params)]
    task = {"op": "measure", "prompt": prompts[0], "new_tokens": 24, "prefill": prompts[0], "repeats": 1}
    f32 = llamacpp.run_worker(PEER, {**task, "gguf": str(paths["f32"]), "greedy": prompts,
                                     "texts": list(llamacpp.GREEDY_PROMPTS)})  # fmt: skip
    assert f32["greedy"] == ours
    assert f32["tokenized"] == prompts  # llama.cpp's tokeniser of the converted vocabulary agrees
    q4 = llamacpp.run_worker(PEER, {**task, "gguf": str(paths["q4_0"]), "greedy": prompts[:1],
                                    "repack": repack_pattern(model.config)})  # fmt: skip
    assert len(q4["greedy"][0]) == 24 and q4["decode_tok_s"] > 0  # the repacked layout runs
