"""`decodekit bench server --hardening`: the server's responsiveness, refusals and a pool.

- health: /health latency (p50/p99 of sequential GETs) while a client sends a 10 MB prompt
  (refused: the body limit) and while 64 streams run;
- big body: the time from sending a 100 MB body's headers (and its first 64 KB) to its 413,
  the rest of the body never sent: what the server spends before refusing, not the
  client's upload (httpx sends a whole body before it reads an answer: 0.9 s of loopback
  writes at 100 MB on this machine);
- pool: best-of-16 on `arith` (its problems, 16 seeded samples each, meta/parallel.py's
  best_of_n with the length scorer) through RemoteGenerator over one `decodekit serve` and
  over two, each server pinned to its own core with `taskset` and one torch thread: the
  answers must be equal (per-sample seeds), and the ratio of samples per second.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time

import numpy as np

from decodekit.bench.server import Connection, free_port, http_request, request_body, start_server

SERVED = "bench"


def start(model: str, port: int, core: int | None = None, timeout: float = 120.0) -> subprocess.Popen:
    """A one-thread server (bench/server.py `start_server`), pinned to `core` where given."""
    return start_server(model, port, timeout, core, ("--threads", "1"))


def quantiles(values: list[float]) -> dict:
    ms = np.array(values) * 1e3
    return {"p50_ms": round(float(np.percentile(ms, 50)), 2),
            "p99_ms": round(float(np.percentile(ms, 99)), 2), "count": len(values)}


async def health_while(url: str, busy) -> dict:
    """/health latencies while the coroutine `busy` runs."""
    import httpx

    async with httpx.AsyncClient(timeout=60) as client:
        task = asyncio.ensure_future(busy)
        times = []
        while not task.done() or len(times) < 20:
            start = time.perf_counter()
            assert (await client.get(url + "/health")).status_code == 200
            times.append(time.perf_counter() - start)
            await asyncio.sleep(0.01)
        result = await task
    return {**quantiles(times), **(result or {})}


async def huge_prompt(url: str, megabytes: int) -> dict:
    import httpx

    head = b'{"model": "%s", "max_tokens": 1, "prompt": "' % SERVED.encode()
    body = head + b"a" * (megabytes << 20) + b'"}'
    async with httpx.AsyncClient(timeout=60) as client:
        start = time.perf_counter()
        response = await client.post(url + "/v1/completions", content=body,
                                     headers={"Content-Type": "application/json"})
        return {"status": response.status_code, "answer_ms": round((time.perf_counter() - start) * 1e3, 2)}


async def big_body(url: str, megabytes: int) -> dict:
    """Headers announcing a `megabytes` body and its first 64 KB, then the status line back."""
    host, _, port = url.partition("://")[2].rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = b'{"model": "%s", "max_tokens": 1, "prompt": "' % SERVED.encode()
    length = len(head) + (megabytes << 20) + 2
    start = time.perf_counter()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s:%s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s%s" % (host.encode(), port.encode(), length, head,
                                                      b"a" * (64 << 10)))  # fmt: skip
    status = int((await reader.readline()).split()[1])
    elapsed = time.perf_counter() - start
    writer.close()
    return {"status": status, "answer_ms": round(elapsed * 1e3, 2), "sent_bytes": len(head) + (64 << 10)}


async def streams(url: str, count: int, new_tokens: int) -> dict:
    connections = [Connection(url) for _ in range(count)]
    records = await asyncio.gather(*(http_request(connection, request_body(SERVED, i, new_tokens))
                                     for i, connection in enumerate(connections)), return_exceptions=True)
    for connection in connections:
        await connection.close()
    return {"streams": count, "errors": sum(isinstance(r, BaseException) for r in records)}


def pool_run(urls: list[str], problems: int, samples: int) -> tuple[list[str], float]:
    from decodekit.meta.parallel import best_of_n
    from decodekit.meta.remote import RemoteGenerator
    from decodekit.meta.tasks.arith import format_prompt, generate_problems
    from decodekit.params import SamplingParams

    prompts = [format_prompt(p) for p in generate_problems(problems, seed=3)]
    with RemoteGenerator(urls, SERVED, max_concurrency=8 * len(urls)) as generator:
        generator.generate(prompts[:1], 2, SamplingParams(max_new_tokens=8, seed=0))  # warm-up
        start = time.perf_counter()
        answers = [best_of_n(generator, prompt, samples, lambda text: -len(text),
                             SamplingParams(max_new_tokens=48, seed=i, temperature=0.8)).text
                   for i, prompt in enumerate(prompts)]
        return answers, time.perf_counter() - start


def bench_hardening(model: str = "shakespeare", new_tokens: int = 64, problems: int = 4) -> dict:
    from decodekit.bench.decode import machine

    port = free_port()
    server = start(model, port)
    url = f"http://127.0.0.1:{port}"
    try:
        health = {
            "idle": asyncio.run(health_while(url, asyncio.sleep(0))),
            "10MB_prompt": asyncio.run(health_while(url, huge_prompt(url, 10))),
            "64_streams": asyncio.run(health_while(url, streams(url, 64, new_tokens))),
        }
        big = asyncio.run(big_body(url, 100))
    finally:
        server.terminate()
        server.wait(30)
    ports = [free_port(), free_port()]
    servers = [start("arith", p, core) for p, core in zip(ports, (0, 1))]
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        one, one_s = pool_run(urls[:1], problems, 16)
        two, two_s = pool_run(urls, problems, 16)
    finally:
        for process in servers:
            process.terminate()
            process.wait(30)
    return {"machine": machine(), "model": model, "health": health, "100MB_body": big,
            "pool": {"problems": problems, "samples": 16, "one_server_s": round(one_s, 3),
                     "two_servers_s": round(two_s, 3), "speedup": round(one_s / two_s, 3),
                     "same_answers": one == two, "pinned": bool(shutil.which("taskset"))}}
