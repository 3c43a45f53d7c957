"""`decodekit bench server`: the HTTP server under load, and the same load on the engine.

Closed loop: C clients each send requests one after another, 2 per client at least and 16
per level at least (request i: prompt PROMPTS[i % 5], `new_tokens` tokens with EOS ignored
so every request generates exactly that many, temperature 0.8, seed i, streamed). Per
request: time to first token (send -> first chunk with text) and the gaps between chunks
with text (inter-token latency; a chunk is one token except where the detokeniser holds
back a partial character). Per level: requests/s and generated tokens/s over its wall time.

- http: a `decodekit serve` subprocess on 127.0.0.1 (its own process, as in production),
  clients on asyncio streams in this process (`Connection`: one keep-alive connection
  each), parsing the server-sent events;
- engine: the same load submitted to an in-process `Engine` with the server's
  configuration (`handle.aiter()`): what the server adds is parsing, planning, SSE
  framing, the socket and the client's parsing (the client shares the machine's cores
  with the server process).

Each level runs over HTTP and then on the engine straight away, `repeats` times, so both
see the same background load on a shared machine; a row holds the medians over repeats
(the http row also `vs_engine`: the median of the pairs' http/engine tokens/s) and the
load average is recorded before and after. The server runs with this process's torch threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from decodekit.runtime import progress as progress_bar

PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo!", "KING HENRY:", "First Citizen:\nBefore we proceed",
           "HAMLET:\nTo be, or not"]
LEVELS = (1, 8, 32, 64)
SERVED = "bench"  # the name the server serves the model under


@dataclass
class Record:
    start: float
    chunk_times: list[float] = field(default_factory=list)
    tokens: int = 0


def request_body(model: str, i: int, new_tokens: int) -> dict:
    return {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": new_tokens,
            "temperature": 0.8, "seed": i, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


TEXT = re.compile(rb'"text":"(.)')  # a chunk's text: empty when the next byte is the quote
USAGE = re.compile(rb'"completion_tokens":(\d+)')


class Connection:
    """A client's keep-alive HTTP/1.1 connection on asyncio streams, reading a chunked answer
    with `readline`/`readexactly`. The clients share the machine's cores with the server, so
    their cost per token is kept small: httpx (h11, its pool) cost the client about 0.15 ms of
    CPU per streamed token at 64 streams (this: 0.025), more than the server's event loop, and
    paced the requests so that the engine ran 35-50 of 64 rows (BENCHMARKS.md, issue 16)."""

    def __init__(self, url: str):
        host, _, port = url.partition("://")[2].rpartition(":")
        self.host, self.port = host, int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: dict):
        """Send one POST; returns (status, headers) with the body left to read. A connection
        the server closed while idle (its keep-alive timeout) is opened again."""
        payload = json.dumps(body).encode()
        request = (b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(), self.port,
                                                       len(payload), payload))
        line = b""
        for _ in range(2):
            if self.writer is None or self.reader.at_eof() or self.writer.is_closing():
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            self.writer.write(request)
            with contextlib.suppress(ConnectionError):
                line = await self.reader.readline()
            if line:
                break
            await self.close()
            self.writer = None
        if not line:
            raise RuntimeError(f"{self.host}:{self.port} closed the connection without answering")
        status = int(line.split()[1])
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    async def chunks(self, headers: dict):
        """The answer's body, piece by piece as the server wrote it (chunked or sized)."""
        if headers.get("transfer-encoding", "").lower() != "chunked":
            yield await self.reader.readexactly(int(headers.get("content-length", 0)))
            return
        while size := int((await self.reader.readline()).split(b";")[0], 16):
            yield (await self.reader.readexactly(size + 2))[:-2]
        await self.reader.readline()  # the empty trailer

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()


async def http_request(connection: Connection, body: dict) -> Record:
    """One streamed request. Events are found with two regexes rather than a JSON parse each."""
    record = Record(time.perf_counter())
    status, headers = await connection.post("/v1/completions", body)
    if status != 200:
        text = b"".join([piece async for piece in connection.chunks(headers)])
        raise RuntimeError(f"server answered {status}: {text[:500]!r}")
    pending = b""
    async for raw in connection.chunks(headers):
        now = time.perf_counter()
        *events, pending = (pending + raw).split(b"\n\n")
        for event in events:
            match = TEXT.search(event)
            if match is not None and match.group(1) != b'"':
                record.chunk_times.append(now)
            usage = USAGE.search(event) if match is None else None
            if usage is not None:
                record.tokens = int(usage.group(1))
    return record


async def engine_request(engine, body: dict) -> Record:
    from decodekit.params import SamplingParams

    record = Record(time.perf_counter())
    params = SamplingParams(max_new_tokens=body["max_tokens"], temperature=body["temperature"],
                            seed=body["seed"], ignore_eos=True)
    handle = engine.submit(body["prompt"], params)
    async for delta in handle.aiter():
        if delta.text:
            record.chunk_times.append(time.perf_counter())
        if delta.completion is not None:
            record.tokens = len(delta.completion.token_ids)
    return record


async def run_level(send, concurrency: int, model: str, new_tokens: int, server_pid: int | None = None
                    ) -> dict:
    """`concurrency` closed-loop clients; `send(body)` makes one request and returns its Record.

    CPU time per generated token is measured too, as it depends less than wall time on what
    else the machine runs: this process's (the engine and its readers, or the HTTP clients)
    and, given its pid, the server process's."""
    per_client = max(2, -(-16 // concurrency))
    queue = list(range(concurrency * per_client))

    async def client(k: int) -> list[Record]:
        return [await send(request_body(model, i, new_tokens)) for i in queue[k::concurrency]]

    start, cpu, server_cpu = time.perf_counter(), time.process_time(), process_cpu(server_pid)
    records = [r for rs in await asyncio.gather(*(client(k) for k in range(concurrency))) for r in rs]
    wall = time.perf_counter() - start
    row = summarize(records, concurrency, wall)
    tokens = max(sum(r.tokens for r in records), 1)
    row["cpu_ms_per_token"] = round((time.process_time() - cpu) / tokens * 1000, 3)
    if server_pid is not None:
        row["server_cpu_ms_per_token"] = round((process_cpu(server_pid) - server_cpu) / tokens * 1000, 3)
    return row


def process_cpu(pid: int | None) -> float:
    """User + system CPU seconds of process `pid` and its children (Linux /proc; 0 where
    unavailable): vLLM's engine runs in a child of its API server."""
    from decodekit.bench.vllm_peer import tree_cpu

    return tree_cpu(pid)


def summarize(records: list[Record], concurrency: int, wall: float) -> dict:
    ttft = [r.chunk_times[0] - r.start for r in records if r.chunk_times]
    gaps = [b - a for r in records for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tokens = sum(r.tokens for r in records)

    def ms(values, q):
        return round(float(np.percentile(values, q)) * 1000, 2) if values else None

    return {"concurrency": concurrency, "requests": len(records), "wall_s": round(wall, 3),
            "requests_per_s": round(len(records) / wall, 3), "tokens_per_s": round(tokens / wall, 1),
            "ttft_p50_ms": ms(ttft, 50), "ttft_p95_ms": ms(ttft, 95), "itl_p50_ms": ms(gaps, 50),
            "itl_p95_ms": ms(gaps, 95)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, timeout: float = 120.0, core: int | None = None,
                 extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """A `decodekit serve` subprocess serving `model` as SERVED, once it answers /health
    (pinned to CPU `core` with taskset where given and available)."""
    import httpx

    command = [sys.executable, "-m", "decodekit.cli", "serve", "--model", f"{SERVED}={model}", "--port",
               str(port), *extra]
    if core is not None and shutil.which("taskset"):
        command = ["taskset", "-c", str(core), *command]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {process.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)
    process.terminate()
    raise RuntimeError(f"the server did not answer /health within {timeout} s")


async def bench_levels(url: str, server_pid: int, engine, levels, new_tokens: int, repeats: int,
                       progress: bool = False, peer: tuple[str, str, int | None] | None = None) -> list[dict]:
    """Each level over HTTP, then straight away on the engine (paired, as the machine is shared),
    then on `peer` ((url, served model, pid or None): vLLM) when given, `repeats` times; a row
    holds the median of each figure over the repeats. `progress`: a bar over levels x repeats
    on stderr."""
    def http(url: str, model: str, pid: int | None):
        async def level(c: int) -> dict:
            connections = [Connection(url) for _ in range(c)]
            free = list(connections)

            async def send(body: dict) -> Record:  # each closed-loop client holds one connection
                connection = free.pop()
                try:
                    return await http_request(connection, body)
                finally:
                    free.append(connection)

            try:
                return await run_level(send, c, model, new_tokens, pid)
            finally:
                for connection in connections:
                    await connection.close()
        return level

    async def engine_level(c: int) -> dict:
        return await run_level(lambda body: engine_request(engine, body), c, SERVED, new_tokens)

    modes = {"http": http(url, SERVED, server_pid), "engine": engine_level}
    if peer is not None:
        modes["vllm"] = http(*peer)
    for level in modes.values():  # warm-up: every batch size up to 8, full length
        await level(8)
    rows = []
    with progress_bar(total=len(levels) * repeats, desc="bench server", enabled=progress) as bar:
        for c in levels:
            bar.set_postfix_str(f"{c} clients")
            runs: dict[str, list[dict]] = {mode: [] for mode in modes}
            for _ in range(repeats):
                for mode, level in modes.items():
                    runs[mode].append(await level(c))
                bar.update()
            level_rows = {mode: {"mode": mode, **median_row(runs[mode])} for mode in modes}
            # HTTP over engine (and over the peer) tokens/s of each repeat's pair, same background load
            for other in [m for m in modes if m != "http"]:
                ratios = [h["tokens_per_s"] / e["tokens_per_s"] for h, e in zip(runs["http"], runs[other])]
                level_rows["http"][f"vs_{other}_runs"] = [round(r, 3) for r in ratios]
                level_rows["http"][f"vs_{other}"] = round(float(np.median(ratios)), 3)
            rows += level_rows.values()
    return rows


def median_row(runs: list[dict]) -> dict:
    row = {key: float(np.median([r[key] for r in runs])) if isinstance(runs[0][key], float) else
           runs[0][key] for key in runs[0]}
    row["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
    return row


def bench_server(model: str = "shakespeare", new_tokens: int = 64, levels=LEVELS, repeats: int = 3,
                 progress: bool = False, peer: str | None = None, peer_url: str | None = None) -> dict:
    """The closed-loop load at each level (module docstring); `progress`: a bar on stderr.
    `peer="vllm"`: the same load on a vLLM server too (bench/vllm_peer.py: `peer_url`'s, or
    one started here), interleaved; reported absent when there is none."""
    from decodekit.bench import vllm_peer
    from decodekit.bench.decode import machine
    from decodekit.models.registry import load_model, resolve
    from decodekit.server.backend import Backend, ServerConfig

    if peer not in (None, "vllm"):
        raise ValueError(f"bench server's peer must be 'vllm' or None, got {peer!r}")
    if peer_url is not None and peer is None:
        raise ValueError("peer_url is the vLLM server of peer='vllm'; pass peer='vllm' with it")
    levels = tuple(levels)
    loaded = load_model(model)
    backend = Backend({SERVED: loaded}, ServerConfig())  # the server's engine config
    if SERVED not in backend.engines:
        raise ValueError(f"model {model!r} does not run on the engine (not a NativeLM)")
    engine = backend.engines[SERVED]
    port = free_port()
    import torch

    threads = torch.get_num_threads()
    report: dict = {}
    peer_process, peer_args = None, None
    if peer == "vllm":
        executable = vllm_peer.find_vllm()
        if peer_url is not None:
            base = peer_url.rstrip("/").removesuffix("/v1")
            host, _, peer_port = base.partition("://")[2].rpartition(":")
            pid = vllm_peer.listening_pid(int(peer_port)) if host in ("127.0.0.1", "localhost") else None
            peer_args = (base, vllm_peer.served_model(base), pid)  # pid None: its CPU time is not measured
            report["peer"] = {"vllm": {"available": True, "url": base, "pid": pid}}
        elif executable is None:
            report["peer"] = {"vllm": {"available": False, "reason": vllm_peer.ABSENT}}
        else:
            peer_port = free_port()
            context = getattr(getattr(loaded, "config", None), "max_position_embeddings", None) or 2048
            peer_process = vllm_peer.start_vllm(executable, resolve(model)[1], SERVED, peer_port, threads,
                                                context)
            peer_args = (f"http://127.0.0.1:{peer_port}", SERVED, peer_process.pid)
            report["peer"] = {"vllm": {"available": True, "executable": str(executable), "threads": threads}}
    process = None
    try:
        process = start_server(model, port, extra=("--threads", str(threads)))  # as this one
        engine.start()
        load_before = os.getloadavg()
        url = f"http://127.0.0.1:{port}"
        rows = asyncio.run(bench_levels(url, process.pid, engine, levels, new_tokens, repeats, progress,
                                        peer_args))
        load = [round(x, 2) for x in load_before + os.getloadavg()]
    finally:
        engine.stop()
        if process is not None:
            process.terminate()
            process.wait(30)
        if peer_process is not None:
            vllm_peer.stop(peer_process)
    return {"model": model, "new_tokens": new_tokens, "repeats": repeats, "machine": machine(),
            "load_average_before_after": load, "rows": rows, **report}


def table(result: dict) -> str:
    """Markdown: one row per concurrency, http and engine side by side."""
    by = {(r["mode"], r["concurrency"]): r for r in result["rows"]}
    lines = ["| clients | mode | req/s | tok/s | http / engine | TTFT p50 / p95 (ms) | ITL p50 / p95 (ms) "
             "| CPU ms/token |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for c in sorted({r["concurrency"] for r in result["rows"]}):
        for mode in ("http", "engine", "vllm"):
            r = by.get((mode, c))
            if r is not None:
                ratio = f"{r['vs_engine']:.2f}" if "vs_engine" in r else ""
                ratio += f" (vs vLLM {r['vs_vllm']:.2f})" if "vs_vllm" in r else ""
                lines.append(f"| {c} | {mode} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.0f} | "
                             f"{ratio} | {r['ttft_p50_ms']:.0f} / {r['ttft_p95_ms']:.0f} | "
                             f"{r['itl_p50_ms']:.1f} / {r['itl_p95_ms']:.1f} | {cpu_text(r)} |")
    return "\n".join(lines)


def cpu_text(row: dict) -> str:
    if "server_cpu_ms_per_token" in row:  # http: server process + client process
        return f"{row['server_cpu_ms_per_token']:.2f} + {row['cpu_ms_per_token']:.2f}"
    return f"{row['cpu_ms_per_token']:.2f}"
