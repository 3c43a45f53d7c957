"""bench/startup.py: fresh processes timed by their CPU and wall time; llama.cpp's answer where
the peer is built, a note where it is not."""

from __future__ import annotations

import json
import sys

import pytest

from decodekit.bench import llamacpp, startup
from decodekit.bench.startup import bench_startup, run_once


def test_run_once_counts_the_childs_cpu_not_ours():
    busy = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\nprint('ok')"
    run = run_once([sys.executable, "-c", busy], startup.child_environment())
    assert run["stdout"] == "ok\n"
    assert 0.3 <= run["cpu_s"] < 3 and run["wall_s"] >= 0.3 * 0.9
    idle = run_once([sys.executable, "-c", "import time; time.sleep(0.3)"], startup.child_environment())
    assert idle["cpu_s"] < 0.3 <= idle["wall_s"]


def test_a_failing_command_is_an_error_with_its_stderr():
    with pytest.raises(RuntimeError, match="exited 3: no model"):
        run_once([sys.executable, "-c", "import sys; sys.stderr.write('no model'); sys.exit(3)"], {})


def test_children_write_and_read_bytecode(monkeypatch):
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert "PYTHONDONTWRITEBYTECODE" not in startup.child_environment()


def test_bench_startup_without_the_peer(monkeypatch):
    monkeypatch.setattr(llamacpp, "find_llamacpp", lambda: None)
    seen = []
    real = startup.run_once
    monkeypatch.setattr(startup, "run_once", lambda command, *a: seen.append(command) or real(command, *a))
    report = bench_startup("shakespeare", repeats=1)
    json.dumps(report)
    assert report["llamacpp"] == {"absent": llamacpp.ABSENT}
    assert report["hello_world"]["answer"].startswith("ROMEO:")
    for name in ("import_torch", "hello_world"):
        assert len(report[name]["cpu_s_runs"]) == 1 and report[name]["cpu_s"] > 0
    over = report["hello_world"]["cpu_s"] - report["import_torch"]["cpu_s"]
    assert report["hello_world_over_torch"]["cpu_s"] == pytest.approx(over, abs=1e-3)
    hello = startup.hello_world_command("shakespeare")
    assert hello[1:] == ["-m", "decodekit.cli", "generate", "ROMEO:", "--model", "shakespeare",
                         "--max-new-tokens", "8"]  # fmt: skip
    assert seen.count(hello) == 2  # a warm-up and one round
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        bench_startup(repeats=0)


PEER = llamacpp.find_llamacpp()


@pytest.mark.peer
@pytest.mark.skipif(PEER is None, reason="no llama-cpp-python build: bash scripts/peers.sh")
def test_llama_cpp_answers_eight_greedy_tokens_of_shakespeare():
    run, gguf = startup.llamacpp_runner("shakespeare")
    assert run is not None, gguf
    answer = json.loads(run()["stdout"])
    assert len(answer["tokens"]) == 8 and answer["text"]
