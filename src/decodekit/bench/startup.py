"""`decodekit bench startup`: how long a user waits for a first answer (issue 26).

Three commands, each a fresh process of its own, run in interleaved rounds (a change of load
on a shared machine moves all three alike) after one warm-up run each, which writes Python's
bytecode cache and reads the files into the page cache, as any second run of an installed
package finds them ("after setup"; `PYTHONDONTWRITEBYTECODE` is dropped from the children's
environment so that the cache is written and read):

- `import_torch`: `python -c "import torch"`, the floor of every PyTorch program;
- `hello_world`: `decodekit generate "ROMEO:" --max-new-tokens 8` (`python -m decodekit.cli`
  with this interpreter), from the process's start to its exit: imports, loading the model
  and its tokenizer, 8 sampled tokens, the text printed;
- `llamacpp`: llama.cpp (llama-cpp-python in the peer's venv, bench/llamacpp.py
  `find_llamacpp`) from its process's start to its exit: importing the binding, loading the
  model's f32 GGUF (converted once by `bench packed --peer llamacpp`; this benchmark converts
  it too where the converter is there), 8 greedy tokens after "ROMEO:", the text printed
  (bench/llamacpp_worker.py `answer`), on one thread as decodekit's hello world. Reported
  absent, with the reason, where there is no peer.

Each figure is the median over `repeats` rounds of the child's CPU time (user + system,
`resource.getrusage(RUSAGE_CHILDREN)`) and its wall time; every run's figures are kept.
`hello_world_over_torch` is the hello world's median less torch's import: what decodekit's
own work costs.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from decodekit.bench import llamacpp
from decodekit.bench.decode import machine

NEW_TOKENS = 8
PROMPT = "ROMEO:"


def run_once(command: list[str], env: dict[str, str], stdin: str | None = None) -> dict:
    """CPU (user + system) and wall seconds of one run of `command` to its exit."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, input=stdin, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command[:4])} ... exited {done.returncode}: {done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"cpu_s": cpu, "wall_s": wall, "stdout": done.stdout}


def child_environment() -> dict[str, str]:
    """This process's environment, with bytecode caching on (module docstring)."""
    return {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}


def hello_world_command(model: str) -> list[str]:
    return [sys.executable, "-m", "decodekit.cli", "generate", PROMPT, "--model", model,
            "--max-new-tokens", str(NEW_TOKENS)]  # fmt: skip


def llamacpp_runner(model: str) -> tuple[Callable[[], dict] | None, str]:
    """A function that runs llama.cpp's answer once, and a note: where its GGUF is, or why
    there is none."""
    peer = llamacpp.find_llamacpp()
    if peer is None:
        return None, llamacpp.ABSENT
    gguf = peer.directory / f"{model}-f32.gguf"
    if not gguf.exists():
        try:
            with tempfile.TemporaryDirectory(prefix="decodekit-gguf-") as scratch:
                gguf = llamacpp.ggufs(peer, model, Path(scratch))["f32"]
        except (RuntimeError, ValueError) as error:
            return None, f"no GGUF of {model!r} in {peer.directory}: {error}"
    task = json.dumps({"op": "answer", "gguf": str(gguf), "prompt": PROMPT, "new_tokens": NEW_TOKENS,
                       "context": 512, "threads": 1})  # fmt: skip
    command = [str(peer.python), str(llamacpp.WORKER)]
    return (lambda: run_once(command, child_environment(), task)), str(gguf)


def summary(runs: list[dict]) -> dict:
    cpu, wall = [r["cpu_s"] for r in runs], [r["wall_s"] for r in runs]
    return {"cpu_s": round(statistics.median(cpu), 3), "wall_s": round(statistics.median(wall), 3),
            "cpu_s_runs": [round(c, 3) for c in cpu], "wall_s_runs": [round(w, 3) for w in wall]}


def bench_startup(model: str = "shakespeare", repeats: int = 5, progress: bool = False) -> dict:
    """Median CPU and wall seconds of importing torch, of decodekit's hello world and of
    llama.cpp's answer, each in fresh processes (module docstring); `progress`: a bar over
    the rounds."""
    from decodekit.runtime import progress as progress_bar

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    env = child_environment()
    runners: dict[str, Callable[[], dict]] = {
        "import_torch": lambda: run_once([sys.executable, "-c", "import torch"], env),
        "hello_world": lambda: run_once(hello_world_command(model), env),
    }
    peer, peer_note = llamacpp_runner(model)
    if peer is not None:
        runners["llamacpp"] = peer
    answers = {name: run()["stdout"].strip() for name, run in runners.items()}  # warm-up
    runs: dict[str, list[dict]] = {name: [] for name in runners}
    for _ in progress_bar(range(repeats), desc="bench startup", enabled=progress):
        for name, run in runners.items():
            runs[name].append(run())
    result = {"command": f'decodekit generate "{PROMPT}" --model {model} --max-new-tokens {NEW_TOKENS}',
              "repeats": repeats, "machine": {k: v for k, v in machine().items() if k != "threads"},
              **{name: summary(done) for name, done in runs.items()}}  # fmt: skip
    result["hello_world_over_torch"] = {
        key: round(result["hello_world"][key] - result["import_torch"][key], 3) for key in ("cpu_s", "wall_s")
    }
    result["hello_world"]["answer"] = answers["hello_world"]
    if peer is not None:
        result["llamacpp"].update(json.loads(answers["llamacpp"]), gguf=peer_note)
    else:
        result["llamacpp"] = {"absent": peer_note}
    return result
