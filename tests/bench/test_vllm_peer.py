"""vLLM as the peer of `bench server --peer vllm` (bench/vllm_peer.py). vLLM itself cannot be
installed in CI, so a stand-in `vllm` executable takes vLLM's command line and serves the
same model with `decodekit serve`: what is tested is the wiring (finding, starting and
stopping the peer, its interleaved rows, ratios and CPU time), not vLLM."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from decodekit.bench import vllm_peer
from decodekit.bench.server import bench_server, table
from decodekit.cli import main

FAKE_VLLM = """\
#!{python}
# Takes `vllm serve DIR --served-model-name NAME ... --port PORT` and serves DIR with decodekit.
import argparse, os, sys
p = argparse.ArgumentParser()
p.add_argument("command"); p.add_argument("directory"); p.add_argument("--served-model-name")
for flag in ("--dtype", "--max-model-len", "--host", "--port"):
    p.add_argument(flag)
a = p.parse_args()
assert a.command == "serve" and os.environ["OMP_NUM_THREADS"] == "1", (a, os.environ["OMP_NUM_THREADS"])
os.execv(sys.executable, [sys.executable, "-m", "decodekit.cli", "serve", "--model",
         a.served_model_name + "=" + a.directory, "--port", a.port, "--threads", "1"])
"""


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    path = tmp_path / "vllm"
    path.write_text(textwrap.dedent(FAKE_VLLM.format(python=sys.executable)))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("DECODEKIT_VLLM", str(path))
    return path


def test_vllm_is_named_by_the_environment_and_absent_when_it_names_nothing(fake_vllm, monkeypatch):
    assert vllm_peer.find_vllm() == fake_vllm
    monkeypatch.setenv("DECODEKIT_VLLM", str(fake_vllm.parent / "missing"))
    assert vllm_peer.find_vllm() is None


def own_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_tree_cpu_counts_the_children():
    spin = "x = 0\nwhile True: x += 1"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}])"
    child = subprocess.Popen([sys.executable, "-c", parent])
    try:
        deadline = time.monotonic() + 30  # the grandchild spins while its parent waits (a loaded machine)
        while vllm_peer.tree_cpu(child.pid) - own_cpu(child.pid) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert vllm_peer.tree_cpu(child.pid) - own_cpu(child.pid) >= 0.3
    finally:
        for pid in Path(f"/proc/{child.pid}/task/{child.pid}/children").read_text().split():
            os.kill(int(pid), 9)
        child.kill()
        child.wait()


def test_bench_server_runs_the_peer_interleaved_and_stops_it(tiny_llama_dir, one_thread, fake_vllm):
    report = bench_server(str(tiny_llama_dir), new_tokens=4, levels=(1,), repeats=1, peer="vllm")
    assert report["peer"]["vllm"]["available"] and report["peer"]["vllm"]["threads"] == 1
    rows = {row["mode"]: row for row in report["rows"]}
    assert set(rows) == {"http", "engine", "vllm"}
    assert rows["vllm"]["requests"] == rows["http"]["requests"] == 16
    ratio = rows["http"]["tokens_per_s"] / rows["vllm"]["tokens_per_s"]
    assert rows["http"]["vs_vllm"] == pytest.approx(ratio, rel=1e-2)
    assert rows["vllm"]["server_cpu_ms_per_token"] > 0  # the peer's process tree was measured
    assert "vs vLLM" in table(report)


def test_bench_server_refuses_another_peer():
    with pytest.raises(ValueError, match="peer must be 'vllm' or None, got 'llamacpp'"):
        bench_server("shakespeare", peer="llamacpp")


@pytest.mark.parametrize("argv, message", [
    (["bench", "server", "--peer", "llamacpp"], "bench server takes --peer vllm, not llamacpp"),
    (["bench", "packed", "--peer", "vllm"], "bench packed takes --peer llamacpp, not vllm"),
    (["bench", "server", "--peer-url", "http://127.0.0.1:9"], "--peer-url is the server of --peer vllm"),
    (["bench", "server", "--hardening", "--peer", "vllm"], "no --clients, --repeats or --peer"),
    (["bench", "decode", "--peer-url", "http://127.0.0.1:9"], "--peer-url applies to bench server"),
])
def test_cli_refuses_a_peer_the_benchmark_does_not_take(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
