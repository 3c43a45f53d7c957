"""The server over a long mixed run (issue 37): resident memory, 5xx answers, and the CPU it
uses once the work is done.

    python benchmarks/server_soak.py --requests 2000 --out benchmarks/results/server_soak.json

One `decodekit serve --model shakespeare` (the battery's command, compile policy on its
default, automatic) gets:

1. soak: `--requests` mixed requests from `--clients` closed-loop clients: completions and
   chat, greedy and sampled, n > 1, streamed, log-probabilities, beam search, speculative
   (prompt lookup) and contrastive decoding (the model as its own amateur), best-of-N, a
   constraint, and a few bad requests (each must get a 4xx). Prompts are random word
   sequences (seeded), so the prefix cache keeps meeting new blocks until it is full. The
   server's RSS (/proc/PID/status VmRSS) is sampled every `--every` answers, with /health's
   pool counters;
2. load: `--streams` concurrent streams (the battery's load phase: 64), two requests each;
3. idle: after each of the two bursts, the server's CPU time (/proc/PID/stat, and its
   children's: a compile job) from 0.5 s to 2 s after its last answer, in cores.

`--compile-times fast` (default) points DECODEKIT_CACHE_DIR at a fresh folder whose
compile-times.json records 0.01 s for every bucket, so the automatic policy compiles from
the first decode steps (the compiled kernels are part of the RSS, and compilations run
while the load runs and ends); `machine` keeps the user's cache (a server that has never
measured a warm-up compiles only after ~40 s of decode steps' savings).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

WORDS = [
    "thou",
    "thee",
    "thy",
    "lord",
    "lady",
    "king",
    "queen",
    "love",
    "death",
    "night",
    "day",
    "heaven",
    "earth",
    "sweet",
    "fair",
    "good",
    "noble",
    "gentle",
    "blood",
    "sword",
    "crown",
    "honour",
    "grace",
    "heart",
    "soul",
    "speak",
    "hear",
    "come",
    "go",
    "stay",
    "fly",
    "weep",
    "laugh",
    "sleep",
    "dream",
    "wake",
    "tell",
    "know",
    "think",
    "mark",
    "what",
    "why",
    "how",
    "when",
    "where",
]
SPEAKERS = ("ROMEO", "JULIET", "KING RICHARD", "HAMLET", "MENENIUS", "First Citizen", "GLOUCESTER")
KINDS = (
    "greedy",
    "sampled",
    "n3",
    "stream",
    "logprobs",
    "chat",
    "chat_stream",
    "chat_logprobs",
    "beam",
    "speculative",
    "contrastive",
    "best_of",
    "constrained",
    "penalties",
    "bad",
)
WEIGHTS = (10, 12, 6, 12, 6, 10, 8, 4, 5, 4, 4, 3, 3, 5, 4)
MODEL = "shakespeare"


def prompt(rng: random.Random) -> str:
    return f"{rng.choice(SPEAKERS)}:\n" + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 60)))


def recipe(i: int, rng: random.Random) -> tuple[str, str, dict]:
    """Request i of the soak: (kind, path, body)."""
    kind = rng.choices(KINDS, WEIGHTS)[0]
    tokens = rng.randint(4, 40)
    text = prompt(rng)
    base = {"model": MODEL, "max_tokens": tokens, "seed": i}
    chat = {"model": MODEL, "max_tokens": tokens, "seed": i, "messages": [{"role": "user", "content": text}]}
    completions, chats = "/v1/completions", "/v1/chat/completions"
    bodies = {
        "greedy": (completions, {**base, "prompt": text, "temperature": 0}),
        "sampled": (completions, {**base, "prompt": text, "temperature": 0.8, "top_p": 0.9, "top_k": 40}),
        "n3": (completions, {**base, "prompt": text, "temperature": 1.0, "n": 3}),
        "stream": (
            completions,
            {
                **base,
                "prompt": text,
                "temperature": 0.7,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ),
        "logprobs": (
            completions,
            {**base, "prompt": text, "temperature": 0.9, "logprobs": 3, "echo": i % 2 == 0},
        ),
        "chat": (chats, {**chat, "temperature": rng.choice([0, 0.8])}),
        "chat_stream": (chats, {**chat, "temperature": 0.8, "stream": True}),
        "chat_logprobs": (chats, {**chat, "temperature": 0.6, "logprobs": True, "top_logprobs": 2}),
        "beam": (completions, {**base, "prompt": text, "use_beam_search": True, "num_beams": 3, "n": 2}),
        "speculative": (
            completions,
            {
                **base,
                "prompt": text,
                "temperature": 0.8,
                "draft_model": "prompt-lookup",
                "num_draft_tokens": 4,
            },
        ),
        "contrastive": (
            completions,
            {**base, "prompt": text, "temperature": 0, "amateur_model": MODEL, "contrastive_alpha": 0.1},
        ),
        "best_of": (completions, {**base, "prompt": text, "temperature": 0.9, "best_of": 3}),
        "constrained": (completions, {**base, "prompt": text, "guided_choice": ["yes", "no", "perhaps"]}),
        "penalties": (
            chats,
            {
                **chat,
                "temperature": 0.9,
                "min_p": 0.05,
                "repetition_penalty": 1.2,
                "presence_penalty": 0.5,
                "frequency_penalty": 0.3,
            },
        ),
    }
    if kind != "bad":
        return (kind, *bodies[kind])
    bad = [
        {**base, "prompt": text, "top_p": 1.5},
        {**base, "prompt": text, "model": "nobody"},
        {**base, "prompt": text, "max_tokens": -3},
        {**chat, "n": 2.5},
        {"model": MODEL},
    ]
    path = [completions, completions, completions, chats, completions][i % 5]
    return kind, path, bad[i % 5]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (0 once it has gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def send(client: httpx.AsyncClient, path: str, body: dict) -> int:
    """The answer's status; a stream is read to its end (an error event counts as 500)."""
    if body.get("stream"):
        async with client.stream("POST", path, json=body) as answer:
            failed = False
            async for line in answer.aiter_lines():
                failed |= line.startswith("data: ") and '"error"' in line[:40]
            return 500 if failed and answer.status_code == 200 else answer.status_code
    return (await client.post(path, json=body)).status_code


async def idle_cpu(pid: int, last_answer: float) -> dict:
    """The server's (and its children's) cores used from 0.5 s to 2 s after its last answer."""
    await asyncio.sleep(max(0.0, last_answer + 0.5 - time.perf_counter()))
    pids = [pid, *descendants(pid)]
    start = {p: cpu_seconds(p) for p in pids}
    t0 = time.perf_counter()
    await asyncio.sleep(max(0.0, last_answer + 2.0 - time.perf_counter()))
    seconds = time.perf_counter() - t0
    children = [p for p in pids if p != pid] + [p for p in descendants(pid) if p not in start]
    used = {p: cpu_seconds(p) - start.get(p, 0.0) for p in [pid, *children]}
    return {
        "server_cores": round(used[pid] / seconds, 3),
        "children_cores": round(sum(v for p, v in used.items() if p != pid) / seconds, 3),
        "children": len(children),
        "window_s": round(seconds, 2),
    }


async def soak(url: str, pid: int, requests: int, clients: int, every: int, seed: int) -> dict:
    rng = random.Random(seed)
    plan = [recipe(i, rng) for i in range(requests)]
    statuses: dict[str, Counter] = {kind: Counter() for kind in KINDS}
    curve, done, next_i = [], 0, 0
    started = time.perf_counter()
    last_answer = started

    async def sample(health: httpx.AsyncClient) -> None:
        stats = (await health.get("/health")).json()["models"][MODEL]
        curve.append(
            {
                "requests": done,
                "seconds": round(time.perf_counter() - started, 1),
                "rss_mb": round(rss_mb(pid), 1),
                "cached_blocks": stats["cached_blocks"],
                "used_blocks": stats["used_blocks"],
                "compiling": stats["compiling"],
                "steps": stats["steps"],
            }
        )
        print(json.dumps(curve[-1]), flush=True)

    async with httpx.AsyncClient(base_url=url, timeout=600) as health:
        await sample(health)

        async def client() -> None:
            nonlocal done, next_i, last_answer
            async with httpx.AsyncClient(base_url=url, timeout=600) as http:
                while next_i < len(plan):
                    kind, path, body = plan[next_i]
                    next_i += 1
                    try:
                        status = await send(http, path, body)
                    except httpx.HTTPError as error:
                        status = f"transport:{type(error).__name__}"
                    statuses[kind][status] += 1
                    last_answer = time.perf_counter()
                    done += 1
                    if done % every == 0:
                        await sample(health)

        await asyncio.gather(*(client() for _ in range(clients)))
        idle = await idle_cpu(pid, last_answer)
        compiling = (await health.get("/health")).json()["models"][MODEL]["compiling"]
    return {
        "curve": curve,
        "statuses": {k: dict(v) for k, v in statuses.items() if v},
        "seconds": round(last_answer - started, 1),
        "idle": {**idle, "compiling_at_2s": compiling},
    }


async def load(url: str, pid: int, streams: int, per_stream: int, tokens: int) -> dict:
    """`streams` concurrent streamed completions, `per_stream` each, as the battery's load phase."""
    statuses: Counter = Counter()
    started = time.perf_counter()
    last_answer = started

    async def client(k: int) -> None:
        nonlocal last_answer
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            for j in range(per_stream):
                body = {
                    "model": MODEL,
                    "prompt": SPEAKERS[k % len(SPEAKERS)] + ":",
                    "max_tokens": tokens,
                    "temperature": 0.8,
                    "seed": k * 100 + j,
                    "stream": True,
                }
                try:
                    statuses[await send(http, "/v1/completions", body)] += 1
                except httpx.HTTPError as error:
                    statuses[f"transport:{type(error).__name__}"] += 1
                last_answer = time.perf_counter()

    await asyncio.gather(*(client(k) for k in range(streams)))
    idle = await idle_cpu(pid, last_answer)
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        compiling = (await http.get("/health")).json()["models"][MODEL]["compiling"]
    return {
        "statuses": dict(statuses),
        "seconds": round(last_answer - started, 1),
        "rss_mb": round(rss_mb(pid), 1),
        "idle": {**idle, "compiling_at_2s": compiling},
    }


def fast_compile_times(folder: Path) -> None:
    """compile-times.json recording 0.01 s for every bucket of shakespeare's shape."""
    import decodekit as dk
    from decodekit.engine.compile_policy import shape_key
    from decodekit.engine.compiled import BUCKETS, bucket_name

    key = shape_key(dk.load_model(MODEL))
    times = {f"{key}/{bucket_name(size, prefixed)}": 0.01 for size in BUCKETS for prefixed in (False, True)}
    (folder / "compile-times.json").write_text(json.dumps(times))


def metrics_5xx(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=30).text
    series = [line for line in text.splitlines() if line.startswith("decodekit_http_responses_total")]
    return {
        line.split("{", 1)[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
        for line in series
        if 'status="5' in line
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--every", type=int, default=100, help="answers between RSS samples")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--stream-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile-times", choices=["fast", "machine"], default="fast")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from decodekit.bench.server import free_port

    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as folder:
        if args.compile_times == "fast":
            fast_compile_times(Path(folder))
            env["DECODEKIT_CACHE_DIR"] = folder
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = open(Path(folder) / "server.log", "w")  # noqa: SIM115 -- the server writes it until it ends
        result: dict = {}
        server = subprocess.Popen(
            [sys.executable, "-m", "decodekit.cli", "serve", "--model", MODEL, "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            for _ in range(600):
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.5)
            result |= {
                "args": {k: str(v) for k, v in vars(args).items()},
                "load_before": os.getloadavg(),
                "rss_start_mb": round(rss_mb(server.pid), 1),
            }
            result["soak"] = asyncio.run(
                soak(url, server.pid, args.requests, args.clients, args.every, args.seed)
            )
            result["load"] = asyncio.run(load(url, server.pid, args.streams, 2, args.stream_tokens))
            result["metrics_5xx"] = metrics_5xx(url)
            result["load_after"] = os.getloadavg()
        finally:
            server.terminate()
            server.wait(timeout=120)
            log.close()
            result["server_exit"] = server.returncode
            result["server_log_tail"] = (Path(folder) / "server.log").read_text()[-2000:]
    curve = {row["requests"]: row["rss_mb"] for row in result["soak"]["curve"]}
    at = {n: curve.get(n) for n in (500, args.requests)}
    if at[500] and at[args.requests]:
        result["rss_growth_500_to_end"] = round(at[args.requests] / at[500] - 1, 4)
    print(
        json.dumps(
            {k: v for k, v in result.items() if k != "soak"}
            | {"statuses": result["soak"]["statuses"], "soak_idle": result["soak"]["idle"], "rss": at},
            indent=1,
        )
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
