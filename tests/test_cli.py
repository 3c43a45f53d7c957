import json
import math
import subprocess
import sys
import time

import pytest

from decodekit.cli import main


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


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--top-p", "1.5"], "top_p must be in (0, 1], got 1.5"),
        (["--temperature", "-1"], "temperature must be in [0, inf], got -1.0"),
        (["--top-k", "-2"], "top_k must be an integer >= 0, got -2"),
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
