"""Processes exit cleanly whatever a compilation is doing (issue 37): run a script of
`generate` and `beam_search` calls on `shakespeare` with the automatic compile policy
triggered from the first decode steps, many times, and count the runs that exit 0 with
nothing on stderr.

    python benchmarks/compile_exit.py --runs 20 --script repro   # the issue's reproduction
    python benchmarks/compile_exit.py --runs 20 --script calls   # 200 generate/beam_search calls
    python benchmarks/compile_exit.py --runs 4 --script serve    # the server, SIGTERM/SIGINT

`repro`: eight rounds of `generate` (two prompts, n=2, 24 tokens) and `beam_search` (3
beams, 12 tokens), then the script ends. `calls`: 200 calls, alternating
`generate` (two prompts, n=2, 8 tokens) and `beam_search` (3 beams, 6 tokens). Each run gets
a fresh DECODEKIT_CACHE_DIR whose compile-times.json records 0.01 s for every bucket of the
model's shape, so the policy compiles at once. `serve`: `decodekit serve` gets completions
until /health lists a compilation, then SIGTERM or SIGINT (alternately); a clean run exits 0
with no traceback (uvicorn logs on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = """
import sys
import decodekit as dk
from decodekit.engine.lanes import lanes_for

rounds = int(sys.argv[1])
model = dk.load_model("shakespeare")
calls = 0
for i in range(rounds):
    if rounds == 8:  # the issue's reproduction
        dk.generate(model, ["ROMEO:", "JULIET: O"], dk.SamplingParams(n=2, max_new_tokens=24, seed=i))
        dk.beam_search(model, "KING:", dk.SamplingParams(max_new_tokens=12), num_beams=3)
        calls += 2
    elif i % 2 == 0:
        dk.generate(model, ["ROMEO:", "JULIET: O"], dk.SamplingParams(n=2, max_new_tokens=8, seed=i))
        calls += 1
    else:
        dk.beam_search(model, "KING:", dk.SamplingParams(max_new_tokens=6), num_beams=3)
        calls += 1
lanes = lanes_for(model)
compiling = getattr(lanes, "compiling", None) or sorted(map(str, lanes._pending))
print(calls, "calls;", "compiling", compiling, "ready", sorted(map(str, lanes.ready)))
"""


def cache_with_times(folder: Path) -> None:
    """compile-times.json recording 0.01 s for every bucket of shakespeare's shape."""
    import decodekit as dk
    from decodekit.engine.compile_policy import shape_key
    from decodekit.engine.compiled import BUCKETS, bucket_name

    key = shape_key(dk.load_model("shakespeare"))
    times = {f"{key}/{bucket_name(size, prefixed)}": 0.01 for size in BUCKETS for prefixed in (False, True)}
    (folder / "compile-times.json").write_text(json.dumps(times))


def serve_once(env: dict, run: int) -> subprocess.CompletedProcess:
    """`decodekit serve` on a free port; completions until /health lists a compilation,
    then SIGTERM (even runs) or SIGINT (odd runs) while it compiles."""
    import signal
    import socket

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "decodekit.cli", "serve", "--model", "shakespeare",
                               "--port", str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    compiling = []
    try:
        for _ in range(600):
            try:
                compiling = httpx.get(url + "/health", timeout=5).json()["models"]["shakespeare"]["compiling"]
                if compiling:
                    break
                httpx.post(url + "/v1/completions", timeout=120, json={
                    "model": "shakespeare", "prompt": "ROMEO:", "max_tokens": 24, "n": 2})
            except httpx.TransportError:
                time.sleep(0.5)
    finally:
        server.send_signal(signal.SIGTERM if run % 2 == 0 else signal.SIGINT)
        out, err = server.communicate(timeout=120)
    aborted = any(word in err for word in ("Traceback", "terminate called"))
    return subprocess.CompletedProcess(server.args, server.returncode, f"compiling {compiling}",
                                       err if aborted or server.returncode else "")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--script", choices=["repro", "calls", "serve"], default="repro")
    args = parser.parse_args()
    rounds = 8 if args.script == "repro" else 200
    clean, results = 0, []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as folder:
            cache_with_times(Path(folder))
            env = {**os.environ, "DECODEKIT_CACHE_DIR": folder}
            start = time.perf_counter()
            if args.script == "serve":
                done = serve_once(env, run)
            else:
                done = subprocess.run([sys.executable, "-c", SCRIPT, str(rounds)], env=env,
                                      capture_output=True, text=True, check=False)  # fmt: skip
            seconds = time.perf_counter() - start
        ok = done.returncode == 0 and not done.stderr.strip()
        clean += ok
        results.append({"run": run, "exit": done.returncode, "stderr": done.stderr.strip()[-300:],
                        "stdout": done.stdout.strip()[-200:], "seconds": round(seconds, 1)})  # fmt: skip
        print(json.dumps(results[-1]), flush=True)
    print(f"{args.script}: {clean} of {args.runs} runs exited 0 with nothing on stderr")


if __name__ == "__main__":
    main()
