"""scripts/train_large.sh: the one command that starts, resumes, reports and stops
shakespeare-large's background training (issue 36)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "train_large.sh"


def run(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def test_start_runs_train_lm_with_the_fixed_schedule_in_the_background(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.txt").write_text("x")  # present: no corpus preparation
    # PYTHON=echo: the "training" prints its own command line into the log and exits
    env = {"RUN": str(tmp_path / "run"), "DATA": str(data), "PYTHON": "echo"}
    started = run(env=env)
    assert started.returncode == 0 and "started pid" in started.stdout
    log = tmp_path / "run" / "train.log"
    for _ in range(100):
        if log.exists() and log.read_text():
            break
        time.sleep(0.05)
    args = log.read_text().split()
    assert args[0].endswith("scripts/train_lm.py")
    for flag, value in (("--config", "shakespeare-large"), ("--steps", "1600"),
                        ("--out", str(tmp_path / "run")), ("--data", str(data))):
        assert args[args.index(flag) + 1] == value
    assert {"--fp32", "--keep-best"} <= set(args)
    assert (tmp_path / "run" / "pid").read_text().strip().isdigit()


def test_status_and_stop_when_nothing_runs_and_a_bad_command(tmp_path):
    env = {"RUN": str(tmp_path / "run")}
    assert run("status", env=env).stdout.startswith("not running")
    assert run("stop", env=env).stdout.startswith("not running")
    bad = run("restart", env=env)
    assert bad.returncode == 2 and "usage" in bad.stderr
