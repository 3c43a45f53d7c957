"""llama.cpp as a named peer (bench/llamacpp.py, bench/gguf.py): the parts that need no
build run everywhere; the `peer` tests run against the build scripts/peers.sh makes and
skip without it."""

from __future__ import annotations

import json
import stat
import sys
import textwrap

import pytest
import torch

from decodekit.bench import llamacpp, packed
from decodekit.bench.gguf import gpt2_pre_tokenizer
from decodekit.bench.llamacpp import ABSENT, find_llamacpp, repack_pattern
from decodekit.bench.packed import bench_packed
from decodekit.compress import recipe
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


real_quantized_copy = recipe.quantized_copy

FAKE_WORKER = textwrap.dedent("""
    # A stand-in for llamacpp_worker.py: speaks its session protocol with fixed timings and
    # logs every request, one JSON line each, to the file named by argv[1].
    import json, sys
    log = open(sys.argv[1], "a")
    if sys.argv[2:3] == ["-c"]:
        sys.exit(0)  # "import llama_cpp" succeeds
    task = json.loads(sys.stdin.readline())
    fmt = task["gguf"].rsplit("-", 1)[1].removesuffix(".gguf")
    log.write(json.dumps({"fmt": fmt, **task}) + "\\n"); log.flush()
    print(json.dumps({"ready": True}), flush=True)
    seconds = {"f32": 0.4, "f16": 0.2, "q8_0": 0.1, "q4_0": 0.05}[fmt]
    for line in sys.stdin:
        request = json.loads(line)
        log.write(json.dumps({"fmt": fmt, "do": request["do"]}) + "\\n"); log.flush()
        do = request["do"]
        answer = {"decode": {"cpu_s": seconds, "wall_s": 2 * seconds},
                  "prefill": {"cpu_s": seconds / 4, "wall_s": seconds / 2},
                  "greedy": {"greedy": [[0] * request.get("new_tokens", 0)
                                        for _ in request.get("prompts", [])]},
                  "tokenize": {"tokenized": [[] for _ in request.get("texts", [])]},
                  "info": {"system_info": "fake"}}[do]
        print(json.dumps(answer), flush=True)
""")


def fake_peer(directory, log):
    """A peers directory whose 'python' runs FAKE_WORKER (so `find_llamacpp` takes it) and
    holds the shakespeare GGUFs (empty files: the fake never reads them)."""
    worker = directory / "fake_worker.py"
    python = fake_python(directory, 0)
    worker.write_text(FAKE_WORKER)
    command = f'#!/bin/sh\nexec {sys.executable} {worker} {log} "$@"\n'
    python.joinpath("venv", "bin", "python").write_text(command)
    for fmt in llamacpp.FORMATS:
        (directory / f"shakespeare-{fmt}.gguf").write_bytes(b"x" * 1000)
    return directory


def one_thread_quantized_copy(model, config):
    """recipe.quantized_copy on one torch thread: GPTQ's column loop of small ops took a minute
    of the suite on `bench_packed`'s two threads when the other core was busy; the test is about
    the timed rounds, which still run on two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return real_quantized_copy(model, config)
    finally:
        torch.set_num_threads(threads)


def test_llama_cpp_rounds_run_between_decodekits_with_the_same_threads(tmp_path, monkeypatch, one_thread):
    log = tmp_path / "requests.jsonl"
    peers = fake_peer(tmp_path / "peers", log)
    monkeypatch.setattr(llamacpp, "peer_directories", lambda: [peers])
    order = []  # who ran, in the order the timers ran

    def logged(who, timer):
        return lambda: order.append(who) or timer()

    real_local, real_timers = packed.local, llamacpp.timers
    monkeypatch.setattr(recipe, "quantized_copy", one_thread_quantized_copy)
    monkeypatch.setattr(packed, "local", lambda fn: logged("decodekit", real_local(fn)))
    monkeypatch.setattr(llamacpp, "timers", lambda *a: {
        name: logged("llama.cpp", timer) for name, timer in real_timers(*a).items()})  # fmt: skip
    report = bench_packed("shakespeare", new_tokens=2, repeats=2, prefill_tokens=16, calib_windows=1,
                          calib_length=16, perplexity=False, peer="llamacpp", threads=2)  # fmt: skip
    requests = [json.loads(line) for line in log.read_text().splitlines()]
    sessions = [r for r in requests if r.get("op") == "session"]
    assert {r["fmt"] for r in sessions} == set(llamacpp.FORMATS) and {r["threads"] for r in sessions} == {2}
    timed = [r["fmt"] + " " + r["do"] for r in requests if r.get("do") in ("decode", "prefill")]
    assert timed == [f"{fmt} {do}" for fmt in llamacpp.FORMATS for do in ("decode", "prefill")] * 3
    peer = report["peer"]["llamacpp"]
    assert peer["threads"] == 2 and report["clock"] == "wall"
    rows = {row["format"]: row for row in peer["rows"]}
    assert rows["q4_0"]["decode_tok_s"] == 2 / 0.1 and rows["f32"]["prefill_tok_s"] == 16 / 0.2  # wall
    auto = report["dtype_auto"]["bfloat16_checkpoint"]
    assert set(peer["ratios"]) == {
        "float32 / f32", "bfloat16 / f16", "int8 RTN / q8_0", "int8 RTN g64 / q8_0", "int8 RTN g128 / q8_0",
        "int8 GPTQ / q8_0", "int4 GPTQ / q4_0", "int8 RTN a8 / q8_0", "int8 RTN g32 a8 / q8_0",
        "int4 GPTQ a8 / q4_0", f"auto for a bfloat16 checkpoint ({auto}) / f16"}  # fmt: skip
    ours = {row["config"]: row for row in report["rows"]}
    int4 = ours["int4 GPTQ"]["decode_tok_s"]
    assert peer["ratios"]["int4 GPTQ / q4_0"]["decode_tok_s"] == round(int4 / 20, 2)
    assert peer["greedy_f32"]["tokens_equal"] == [False] * 4  # the fake's zeros are not shakespeare's
    # A warm-up and two rounds, each decodekit's 20 (10 rows, decode and prefill) then llama.cpp's
    # 8 (4 formats): the peer's rows are timed in decodekit's rounds, not after all of them.
    assert order[: 3 * 28] == (["decodekit"] * 20 + ["llama.cpp"] * 8) * 3


def test_a_worker_that_dies_is_an_error_with_its_stderr(tmp_path):
    directory = fake_python(tmp_path / "peers", 0)
    dies = "#!/bin/sh\necho 'cannot load the model' >&2\nexit 3\n"
    directory.joinpath("venv", "bin", "python").write_text(dies)
    with pytest.raises(RuntimeError, match="llama.cpp worker for m-f32.gguf failed: cannot load the model"):
        llamacpp.PeerSession(llamacpp.LlamaCpp(directory), tmp_path / "m-f32.gguf", 64, 1, None)


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
    with llamacpp.PeerSession(PEER, paths["f32"], 64, 1, None) as f32:
        assert f32.ask({"do": "greedy", "prompts": prompts, "new_tokens": 24})["greedy"] == ours
        # llama.cpp's tokeniser of the converted vocabulary agrees
        assert f32.ask({"do": "tokenize", "texts": list(llamacpp.GREEDY_PROMPTS)})["tokenized"] == prompts
    with llamacpp.PeerSession(PEER, paths["q4_0"], 64, 1, repack_pattern(model.config)) as q4:
        assert len(q4.ask({"do": "greedy", "prompts": prompts[:1], "new_tokens": 24})["greedy"][0]) == 24
        timed = q4.ask({"do": "decode", "prompt": prompts[0], "new_tokens": 24})  # the repacked layout runs
        assert timed["cpu_s"] > 0 and timed["wall_s"] > 0


@pytest.mark.peer
@pytest.mark.skipif(PEER is None, reason="no llama-cpp-python build: bash scripts/peers.sh")
def test_llama_cpps_samplers_run_on_the_logits_given(tmp_path):
    """bench/llamacpp_worker.py `samplers` (benchmarks/sampling_vocab.py's peer): llama.cpp's
    greedy picks each row's argmax and top-k 1 the same token, so the candidates are filled
    from the rows given; timings are positive."""
    logits = torch.randn(3, 5_000, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "logits.f32"
    logits.numpy().tofile(path)
    chains = {"greedy": [["greedy"]], "top_k 1": [["top_k", 1], ["dist", 7]]}
    done = llamacpp.run_worker(PEER, {"op": "samplers", "logits": str(path), "rows": 3, "calls": 2,
                                      "chains": chains})  # fmt: skip
    want = logits.argmax(dim=-1).tolist()
    assert done["tokens"] == {"greedy": want, "top_k 1": want}
    assert all(ms > 0 for ms in done["ms"].values())
