import json
import math
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from decodekit.cli import main

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "decodekit.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_help_is_fast_and_lazy():
    start = time.perf_counter()
    out = run_cli("--help")
    assert out.returncode == 0 and "generate" in out.stdout
    assert time.perf_counter() - start < 5  # generous on a loaded machine; no torch import
    probe = subprocess.run([sys.executable, "-c", "import sys, decodekit.cli; "
                            "print('torch' in sys.modules)"], capture_output=True, text=True)
    assert probe.stdout.strip() == "False"


HELLO_WORLD = {
    "cli": "from decodekit.cli import main\n"
           "assert main(['generate', 'ROMEO:', '--max-new-tokens', '4', '--seed', '0']) == 0",
    "api": "import decodekit as dk\n"
           "model = dk.load_model('shakespeare')\n"
           "[[c]] = dk.generate(model, ['ROMEO:'], dk.SamplingParams(max_new_tokens=4))\n"
           "assert len(c.token_ids) == 4 and c.text",
}


@pytest.mark.parametrize("path", sorted(HELLO_WORLD))
def test_hello_world_imports_neither_transformers_nor_dynamo_nor_dtensor(path):
    """Issue 26: importing transformers (for AutoTokenizer) cost the hello world 1.1 s of CPU, as
    it pulls torch.distributed.tensor and torch._dynamo; the shipped models need none of them."""
    heavy = ("transformers", "torch._dynamo", "torch.distributed.tensor")
    probe = HELLO_WORLD[path] + "\nimport sys\n" + \
        f"print(sorted(m for m in sys.modules if m.startswith({heavy!r})))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--top-p", "1.5"], "top_p must be in (0, 1], got 1.5"),
        (["--temperature", "-1"], "temperature must be in [0, inf], got -1.0"),
        (["--top-k", "-2"], "top_k must be an integer >= -1, got -2"),
        (["--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1, got 0"),
        (["--strategy", "nope"], "--strategy must be one of greedy, sample, beam"),
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--model", "./missing/dir"], "model path './missing/dir' does not exist"),
    ],
)
def test_bad_values_exit_nonzero_with_one_line(capsys, flags, message):
    code = main(["generate", "hello", *flags])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_generate_json_on_a_local_checkpoint(tiny_llama_dir):
    out = run_cli("generate", "ROMEO:", "--model", str(tiny_llama_dir), "--max-new-tokens", "5",
                  "--seed", "1", "--n", "2", "--json")
    assert out.returncode == 0, out.stderr
    completions = [json.loads(line) for line in out.stdout.splitlines()]  # one compact line each
    assert len(completions) == 2
    assert all(len(c["token_ids"]) <= 5 for c in completions)


def test_generate_chat_with_tools_prints_calls_that_fit_the_schema(capsys, tmp_path):
    pytest.importorskip("llguidance")
    tools = ROOT / "examples" / "tools.json"
    code = main(["generate", "What time is it in Tokyo?", "--chat", "--tools", str(tools), "--tool-choice",
                 "get_time", "--max-new-tokens", "100", "--seed", "0", "--n", "2", "--json"])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    replies = [json.loads(line) for line in out.out.splitlines()]
    assert len(replies) == 2
    assert all(r["finish_reason"] == "tool_calls" and r["content"] is None for r in replies)
    zones = json.loads(tools.read_text())[0]["function"]["parameters"]["properties"]["zone"]["enum"]
    assert all(c["name"] == "get_time" and json.loads(c["arguments"])["zone"] in zones
               for r in replies for c in r["tool_calls"])  # fmt: skip
    (tmp_path / "bad.json").write_text('{"type": "function"}')
    for flags, message in ((["--tools", str(tmp_path / "bad.json")], "a JSON list of tools"),
                           (["--tool-choice", "required"], "--tool-choice: tool_choice needs tools")):
        code = main(["generate", "x", "--chat", *flags])
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, err


def test_prompt_longer_than_context_fails_cleanly(tiny_llama_dir, capsys):
    code = main(["generate", "x" * 500, "--model", str(tiny_llama_dir)])
    err = capsys.readouterr().err
    assert code == 2 and "the model's context is 96" in err


def test_align_bon_json_and_plot(tmp_path):
    plot = tmp_path / "bon.png"
    out = run_cli("align", "bon", "--n", "4", "--p", "0.5,0.5", "--r", "0,1", "--json",
                  "--plot", str(plot))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    # seed 000's binary example: KL = log 2 - h(1/16), win rate 23/32
    h = -(1 / 16) * math.log(1 / 16) - (15 / 16) * math.log(15 / 16)
    assert report["kl"] == pytest.approx(math.log(2) - h, abs=1e-12)
    assert report["win_rate"] == pytest.approx(23 / 32, abs=1e-12)
    assert [row["n"] for row in report["curve"]] == [1, 2, 3, 4]
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_align_bon_bad_p_is_one_line(capsys):
    assert main(["align", "bon", "--n", "4", "--p", "0.5,0.6", "--r", "0,1"]) == 2
    err = capsys.readouterr().err
    assert "p must sum to 1" in err and err.count("\n") == 1


def test_a_bad_typed_value_is_one_line_not_the_usage():
    out = run_cli("generate", "x", "--seed", "abc")
    assert out.returncode == 2
    assert out.stderr == "decodekit generate: error: argument --seed: invalid int value: 'abc'\n"
    out = run_cli("generate")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "usage" not in out.stderr


def test_version():
    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("decodekit 0.")


def test_stop_escapes():
    from decodekit.cli.common import UsageError, unescape

    assert unescape("--stop", r"\n\n") == "\n\n"
    assert unescape("--stop", r"a\tb\\n\r") == "a\tb\\n\r"
    assert unescape("--stop", r"\u00e9\x41\U0001F600é") == "éA😀é"
    for bad in (r"\q", "trailing\\", r"\x4"):
        with pytest.raises(UsageError, match="unknown escape"):
            unescape("--stop", bad)


def test_json_is_one_compact_line_per_completion(tiny_llama_dir, capsys):
    assert main(["generate", "ROMEO:", "--model", str(tiny_llama_dir), "--max-new-tokens", "4",
                 "--n", "3", "--seed", "0", "--json", "--stop", r"\n"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(line.startswith('{"text": ') for line in lines)
    assert all("\n" not in json.loads(line)["text"] for line in lines)  # --stop "\n" is a newline


def test_max_new_tokens_beyond_the_context_warns(tiny_llama_dir, capsys):
    assert main(["generate", "ROMEO:", "--model", str(tiny_llama_dir), "--max-new-tokens", "500",
                 "--strategy", "greedy", "--json"]) == 0
    out = capsys.readouterr()
    assert "warning: --max-new-tokens 500 is more than the context leaves (96 tokens" in out.err
    assert out.err.count("\n") == 1
    assert json.loads(out.out)["usage"]["completion_tokens"] <= 96


def test_threads_flag_on_every_command_that_runs_a_model(tiny_llama_dir, capsys):
    import torch

    from decodekit.cli import RUNS_A_MODEL, build_parser

    parser = build_parser()
    for command in RUNS_A_MODEL:
        required = {"generate": ["x"], "bench": ["decode"], "eval": ["arith"],
                    "compress": ["m", "--method", "rtn", "--out", "o"], "serve": []}[command]
        assert parser.parse_args([command, *required, "--threads", "3"]).threads == 3
    before = torch.get_num_threads()
    try:
        assert main(["generate", "x", "--model", str(tiny_llama_dir), "--max-new-tokens", "2",
                     "--threads", "2"]) == 0
        assert torch.get_num_threads() == 2
        assert main(["generate", "x", "--model", str(tiny_llama_dir), "--max-new-tokens", "2"]) == 0
        assert torch.get_num_threads() == 1  # automatic: a small model decodes fastest on one
    finally:
        torch.set_num_threads(before)
    assert main(["generate", "x", "--model", str(tiny_llama_dir), "--threads", "0"]) == 2
    assert "threads must be a positive integer, got 0" in capsys.readouterr().err


def test_model_loading_prints_no_progress_bars(tmp_path, capfd):
    """A model on the transformers path (a GPT-2) loads without transformers' "Loading weights"
    bars, and its forward raises no FutureWarning (its old `past_key_values` argument did)."""
    import shutil

    from transformers import GPT2Config, GPT2LMHeadModel

    from decodekit.models.registry import ASSETS

    config = GPT2Config(vocab_size=2048, n_embd=16, n_layer=1, n_head=2, n_positions=64, bos_token_id=0,
                        eos_token_id=0)  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ASSETS / "shakespeare" / name, tmp_path / name)
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["generate", "x", "--model", str(tmp_path), "--max-new-tokens", "2"]) == 0
    assert "Loading weights" not in capfd.readouterr().err
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]


def test_compress_checks_its_output_directory_first(tmp_path, capsys, monkeypatch):
    import decodekit.compress.recipe as recipe

    monkeypatch.setattr(recipe, "compress_to_dir", lambda *a, **k: pytest.fail("compressed anyway"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("x")
    (tmp_path / "a-file").write_text("x")
    for out, message in [(tmp_path / "full", "is not empty"), (tmp_path / "a-file", "is not a directory"),
                         (tmp_path / "a-file" / "sub", "is a file, not a directory")]:
        assert main(["compress", "shakespeare", "--method", "rtn", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


def test_a_missing_optional_dependency_names_the_install_command(capsys, monkeypatch, tmp_path):
    import sys

    import decodekit.meta.evaluate as evaluate
    from decodekit.optional import MissingDependency, install_command

    monkeypatch.chdir(ROOT)
    assert install_command("server") in (".venv/bin/pip install -e '.[server]'",
                                         f"{sys.executable} -m pip install -e '.[server]'")
    monkeypatch.setattr(evaluate, "evaluate_arith", lambda *a, **k: pytest.fail("evaluated anyway"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["eval", "arith", "--plot", str(tmp_path / "acc.png")]) == 1
    err = capsys.readouterr().err
    assert err == f"decodekit eval: error: --plot needs matplotlib, which is not installed; run: " \
                  f"{install_command('eval')}\n"
    monkeypatch.setitem(sys.modules, "llguidance", None)
    monkeypatch.setitem(sys.modules, "llguidance.hf", None)
    from weakref import WeakKeyDictionary

    import decodekit as dk
    import decodekit.decode.constrained as constrained
    import decodekit.decode.healing as healing

    # as on a machine without llguidance: nothing earlier tests built is cached
    monkeypatch.setattr(constrained, "_TOKENIZERS", WeakKeyDictionary())
    monkeypatch.setattr(healing, "_TOKEN_BYTES", WeakKeyDictionary())

    with pytest.raises(MissingDependency, match=r"install -e '\.\[constrained\]'"):
        dk.Regex("a")
    assert main(["generate", "x", "--regex", "a"]) == 1
    assert "[constrained]" in capsys.readouterr().err
    assert main(["generate", "ROMEO: Good mor", "--heal", "--max-new-tokens", "2"]) == 1  # llguidance too
    assert "[constrained]" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "fastapi", None)
    monkeypatch.delitem(sys.modules, "decodekit.server.app", raising=False)
    assert main(["serve"]) == 1
    err = capsys.readouterr().err
    assert "the server needs fastapi" in err and "[server]" in err and err.count("\n") == 1


def test_progress_on_a_terminal_or_off_it_and_never_with_json(monkeypatch, capsys, tmp_path):
    import io
    import sys

    import decodekit.compress.recipe as recipe
    import decodekit.meta.evaluate as evaluate

    seen = []
    monkeypatch.setattr(evaluate, "evaluate_arith", lambda *a, progress, **k: seen.append(progress) or {})
    monkeypatch.setattr(evaluate, "table", lambda report: "")
    report = dict(model="m", out="o", label="rtn-8b", layers=1, memory_bytes_before=2,
                  memory_bytes_after=1, disk_bytes=1)
    monkeypatch.setattr(recipe, "compress_to_dir", lambda *a, progress, **k: seen.append(progress) or report)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stderr, flags, expected in [(Terminal(), [], True), (Terminal(), ["--json"], False),
                                    (io.StringIO(), [], True), (io.StringIO(), ["--json"], False)]:
        monkeypatch.setattr(sys, "stderr", stderr)
        seen.clear()
        assert main(["eval", "arith", *flags]) == 0
        assert main(["compress", "m", "--method", "rtn", "--out", str(tmp_path / "new"), *flags]) == 0
        assert seen == [expected, expected]


def test_dtype_flag_loads_the_model_in_that_dtype(capsys, tmp_path):
    from decodekit.server.app import load_models

    args = ["generate", "ROMEO:", "--strategy", "greedy", "--max-new-tokens", "4", "--json"]
    assert main([*args, "--dtype", "bfloat16"]) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert len(bf16["token_ids"]) == 4 and all(lp <= 0 for lp in bf16["logprobs"])
    # A few windows are enough to show that --dtype reaches eval perplexity: the whole README
    # was over a hundred bfloat16 windows (10 s of this test).
    text = tmp_path / "text.txt"
    text.write_text((ROOT / "README.md").read_text()[:1500])
    assert main(["eval", "perplexity", "shakespeare", "--dtype", "bfloat16", "--window", "64",
                 "--text", str(text)]) == 0  # fmt: skip
    assert "perplexity" in capsys.readouterr().out
    assert main(["bench", "decode", "--dtype", "bfloat16", "--new-tokens", "2", "--repeats", "1",
                 "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["dtype"] == "bfloat16"
    assert str(load_models(["shakespeare"], dtype="bfloat16")["shakespeare"].dtype) == "torch.bfloat16"
    assert main([*args, "--device", "auto"]) == 0 and main([*args, "--device", "cpu"]) == 0
    assert load_models(["shakespeare"], device="cpu")["shakespeare"].device.type == "cpu"


@pytest.mark.parametrize("args, message", [
    (["generate", "x", "--dtype", "bf16"],
     "dtype must be one of 'auto', 'float32', 'bfloat16', 'float16' (or the torch dtype), got 'bf16'"),
    (["eval", "arith", "--dtype", "bfloat16"], "--dtype applies to eval perplexity, not eval arith"),
    (["bench", "constrained", "--dtype", "bfloat16"],
     "--dtype applies to bench decode, engine and latency, not bench constrained"),
    (["generate", "x", "--device", "gpu"],
     "device must be one of 'auto', 'cpu', 'cuda', 'mps' (or 'cuda:N'), got 'gpu'"),
    (["eval", "arith", "--device", "cpu:0"], "--device applies to eval perplexity, not eval arith"),
    (["bench", "server", "--device", "cuda"],
     "--device applies to bench decode, engine and dtype, not bench server"),
    (["bench", "speculative", "--shape", "llama-3.2-1b"],
     "--shape applies to bench decode, engine and dtype, not bench speculative"),
    (["bench", "decode", "--shape", "llama-3.2-1b", "--model", "arith"], "give --model or --shape, not both"),
    (["bench", "dtype", "--batches", "0,4"], "--batches must be comma-separated positive integers"),
    (["generate", "x", "--model", "shakespeare-5gram", "--dtype", "bfloat16"],
     "ngram model 'shakespeare-5gram' runs in float32 only"),
    (["bench", "decode", "--clients", "16"],
     "--clients applies to bench speculative, server, beam and soak, not bench decode"),
    (["bench", "speculative", "--clients", "0"],
     "--clients must be comma-separated positive integers, got '0'"),
    (["bench", "beam", "--clients", "8,16"], "--clients must be one positive integer here, got '8,16'"),
    (["bench", "kv", "--new-tokens", "16"], "--new-tokens applies to bench decode, engine, dtype, compress"),
    (["bench", "dtype", "--dtype", "bfloat16"], "--dtype applies to bench decode, engine and latency"),
    (["bench", "speculative", "--quick", "--clients", "4"], "--quick shortens the sweep"),
    (["bench", "speculative", "--prompt-tokens", "256"],
     "--prompt-tokens sets the prompt length of bench speculative --clients N; give --clients"),
    (["bench", "speculative", "--clients", "2", "--prompt-tokens", "0"],
     "--prompt-tokens must be a positive integer, got 0"),
    (["bench", "server", "--prompt-tokens", "256"],
     "--prompt-tokens applies to bench speculative, not bench server"),
    (["bench", "speculative", "--model", "shakespeare", "--draft-model", "shakespeare-draft",
      "--clients", "2", "--prompt-tokens", "500", "--new-tokens", "16"],
     "prompt_tokens + new_tokens + gamma = 500 + 16 + 4 = 520 is past shakespeare's context of 512"),
    (["bench", "speculative", "--model", "arith"],
     "bench speculative: 'arith' has no embedded draft model; give --draft-model"),
    (["bench", "server", "--hardening", "--repeats", "2"], "--hardening runs its own fixed load"),
    (["compress", "m", "--method", "rtn", "--calib", "8", "--out", "o"],
     "--calib applies to the methods that calibrate (gptq, sparsegpt), not rtn"),
    (["eval", "alignment", "--model", "arith"], "--model applies to eval arith and perplexity"),
    (["eval", "perplexity", "--width", "3"], "--width applies to eval arith, not eval perplexity"),
    (["eval", "perplexity", "--text", "README.md", "--split", "val"], "give --text or --split, not both"),
    (["generate", "x", "--num-beams", "3"], "--num-beams applies to --strategy beam, not sample"),
    (["generate", "x", "--num-draft-tokens", "3"], "--num-draft-tokens applies to speculative decoding"),
    (["generate", "x", "--no-fallback"], "--no-fallback applies to speculative decoding"),
    (["bench", "latency", "--peer", "llamacpp"],
     "--peer applies to bench packed and server, not bench latency"),
    (["bench", "engine", "--peer", "llamacpp"],
     "--peer applies to bench packed and server, not bench engine"),
])  # fmt: skip
def test_a_bad_dtype_is_one_line_naming_what_is_allowed(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_models_shows_what_dtype_auto_does_on_this_cpu(capsys, tmp_path, monkeypatch):
    from decodekit.models import dtype_probe

    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path))
    timings = {"decode_float32": 0.004, "decode_bfloat16": 0.005, "prefill_float32": 0.006,
               "prefill_bfloat16": 0.002}  # fmt: skip
    monkeypatch.setattr(dtype_probe, "measure", lambda: timings)
    main(["models"])
    assert (
        "a bfloat16 checkpoint loads as float32 (bfloat16 decodes at 0.8x float32, prefills at 3.0x"
        in capsys.readouterr().out
    )
    main(["models", "--dtype-report"])
    report = json.loads(capsys.readouterr().out)
    assert report["bfloat16_checkpoint"] == "float32" and report["cached"]


def test_ctrl_c_while_streaming_is_a_newline_and_one_line(capsys, monkeypatch):
    """In process: the stream raises KeyboardInterrupt after two chunks."""
    from types import SimpleNamespace

    from decodekit.decode.sample import Sample

    def interrupted_stream():
        class Delta:
            text, completion = "But", None

        yield Delta()
        yield Delta()
        raise KeyboardInterrupt

    monkeypatch.setattr(Sample, "prepare", lambda *a, **k: SimpleNamespace(deltas=interrupted_stream))
    assert main(["generate", "ROMEO:", "--stream", "--max-new-tokens", "8"]) == 130
    out = capsys.readouterr()
    assert out.out == "ROMEO:ButBut\n"  # the streamed line ended
    assert out.err == "decodekit generate: interrupted\n"


def test_ctrl_c_in_a_real_stream_exits_130_without_a_traceback():
    """A subprocess streaming 500 tokens gets SIGINT once its first chunk is out."""
    import os
    import signal

    # A terminal's Ctrl-C reaches a child whose SIGINT is at its default. An earlier test of the
    # whole suite can leave this process ignoring SIGINT, which a child inherits (and Python
    # then keeps: no KeyboardInterrupt, exit 0, every token out; seen in CI): reset it there.
    def default_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    process = subprocess.Popen([sys.executable, "-m", "decodekit.cli", "generate", "ROMEO:", "--stream",
                                "--max-new-tokens", "500", "--seed", "0", "--threads", "1"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ},
                               preexec_fn=default_sigint)
    try:
        first = process.stdout.read(len("ROMEO:") + 1)  # the prompt, then a generated character
        process.send_signal(signal.SIGINT)
        rest, err = process.communicate(timeout=60)
    finally:
        process.kill()
    out = (first + rest).decode()
    assert process.returncode == 130, err.decode()
    assert err.decode() == "decodekit generate: interrupted\n"
    assert out.startswith("ROMEO:") and out.endswith("\n") and len(out) < 1400  # cut short
