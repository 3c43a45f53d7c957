"""The OpenAI-compatible HTTP server (FastAPI): `decodekit serve`.

    GET  /health                 {"status": "ok", ...engine and request counters}
    GET  /metrics                the same and HTTP answers by status, in Prometheus' text format
    GET  /v1/models              the served models
    POST /v1/completions         prompt -> text (stream: server-sent events, then [DONE])
    POST /v1/chat/completions    messages -> assistant message
    GET  /lab                    decodekit lab: the algorithms at work, step by step (lab.py)

A request is parsed (protocol.py), planned (request_plan.py: every bad value is a 400 naming its
field), started on the backend (backend.py: the engine, or the worker thread), then
either collected into one body or streamed as OpenAI chunks. A client that disconnects
cancels its jobs (their KV blocks return to the pool at the engine's next step); a request
that outlives `request_timeout` is cancelled and answered 504 (an error event when
streaming). Every failure is answered with an OpenAI-style error body; the server keeps
serving. In front of the routes, server/guard.py checks the `Host`, `Origin`, API key,
content type and body size. Parsing and tokenising a request run in a worker thread, so a
huge prompt never stalls `/health` or other streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from decodekit.optional import missing, require

try:
    from fastapi import FastAPI, Request
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect

    from decodekit.server.metrics import CountStatus, Metrics, TokenClock
    from decodekit.server.openapi import openapi_document
except ImportError as error:
    raise missing(error.name or "fastapi", "server", "the server") from None

from decodekit.completion import Completion, Usage
from decodekit.decode.reasoning import ThinkingStream
from decodekit.decode.tool_calls import ToolCallStream
from decodekit.models.base import LanguageModel
from decodekit.request import Delta
from decodekit.server import protocol, responses, tokenize
from decodekit.server.backend import Backend, Job, QueueFull
from decodekit.server.guard import Guard, host_policy
from decodekit.server.lab import BODIES as LAB_BODIES
from decodekit.server.lab import lab_router
from decodekit.server.protocol import APIError, ChatRequest, CompletionRequest, error_body
from decodekit.server.request_plan import Plan, api_error, launch, plan_request

log = logging.getLogger(__name__)


def create_app(backend: Backend, host: str = "127.0.0.1") -> FastAPI:
    """The app over `backend`, for a server bound to `host` (which `Host` headers it accepts)."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        backend.start()
        yield
        backend.stop()

    app = FastAPI(title="decodekit", lifespan=lifespan)
    # the bodies the routes parse themselves, declared
    app.openapi = lambda: openapi_document(app, backend.models, backend.config)
    app.state.backend = backend
    config = backend.config
    app.add_middleware(Guard, api_key=config.api_key, hosts=host_policy(host, config.allowed_hosts),
                       bodies=("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                               *LAB_BODIES),
                       origins=config.cors_origins, max_body_bytes=config.max_body_bytes)
    if config.cors_origins:  # outside the guard: answers preflights, adds CORS headers to every answer
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.state.metrics = metrics = Metrics(backend)
    app.add_middleware(CountStatus, metrics=metrics)  # outermost: refusals are counted too

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, error: HTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(error.detail), kind), status_code=error.status_code,
                            headers=error.headers)  # 405 carries Allow

    @app.exception_handler(Exception)
    async def on_bug(request: Request, error: Exception):
        return JSONResponse(error_body(f"internal error: {type(error).__name__}: {error}", "server_error",
                                       code="internal_error"), status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok", **backend.stats()}

    @app.get("/metrics")
    async def prometheus():
        content, media_type = metrics.render()
        return Response(content, media_type=media_type)

    @app.get("/v1/models")
    async def models():
        return protocol.ModelList(data=[model_card(name, backend) for name in backend.models]).model_dump()

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        served = backend.served_name(name)
        if served is None:
            raise APIError(404, f"The model '{name}' does not exist", "model", "model_not_found")
        return model_card(served, backend).model_dump()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, CompletionRequest, backend)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await answer(request, ChatRequest, backend)

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        req = protocol.parse_request(protocol.TokenizeRequest, await request.body())
        return (await backend.run_blocking(tokenize.tokenize, req, backend)).model_dump()

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        req = protocol.parse_request(protocol.DetokenizeRequest, await request.body())
        return (await backend.run_blocking(tokenize.detokenize, req, backend)).model_dump()

    app.include_router(lab_router(backend))  # GET /lab: the lab page and its JSON routes (lab.py)
    return app


def model_card(name: str, backend: Backend) -> protocol.ModelCard:
    return protocol.ModelCard(id=name, created=0, max_model_len=backend.models[name].max_context)


def parse_and_plan(kind: type, body: bytes, backend: Backend) -> Plan:
    return plan_request(protocol.parse_request(kind, body), backend)


async def answer(request: Request, kind: type, backend: Backend):
    clock = request.app.state.metrics.clock()
    try:
        body = await request.body()
    except ClientDisconnect:  # gone mid-upload: one line, not an ASGI traceback
        log.debug("%s %s: the client disconnected while sending its body", request.method, request.url.path)
        raise APIError(499, "client closed the request", None, "client_closed") from None
    backend.counters["requests"] += 1
    plan = await backend.run_blocking(parse_and_plan, kind, body, backend)  # tokenising: off the loop
    # the body keys the server ignored (request_plan.py), named for the client (vLLM only logs them),
    # and the tokens truncation cut from each prompt (usage counts the tokens kept)
    headers = {"X-Ignored-Fields": header_list(plan.ignored)} if plan.ignored else {}
    if plan.dropped:
        headers["X-Prompt-Tokens-Dropped"] = ", ".join(map(str, plan.dropped))
    jobs = [] if plan.score_only else start(plan, backend)
    rid = ("chatcmpl-" if plan.chat else "cmpl-") + uuid.uuid4().hex
    if plan.stream:
        return StreamingResponse(stream(plan, jobs, rid, backend, clock), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **headers})
    drawn = await guarded(collect_all(plan, jobs, backend, clock), request, jobs, backend)
    model = backend.models[plan.model]
    chosen = drawn
    if plan.selection is not None:
        scorer = backend.scorer(plan.selection.scorer)
        chosen = [await backend.run_blocking(responses.select, plan.selection, plan.n, text, completions,
                                             scorer)
                  for text, completions in zip(plan.prompt_texts, drawn)]
    if plan.chat:
        body = responses.chat_body(plan, model, rid, chosen, drawn)
    else:
        echoes = [None] * len(plan.prompts)
        if plan.echo and plan.logprobs is not None:
            echoes = [await backend.run_blocking(responses.prompt_logprobs, model, ids, plan.logprobs)
                      for ids in plan.prompts]
        body = responses.completion_body(plan, model, rid, chosen, drawn, echoes)
    return JSONResponse(body, headers=headers) if headers else body


def header_list(names: tuple[str, ...]) -> str:
    """Names for a header value: escaped as JSON strings are (printable ASCII), since a
    header is latin-1 (Starlette raised on anything else: a 500) and CR LF would end it."""
    return ", ".join(json.dumps(name)[1:-1] for name in names)


def start(plan: Plan, backend: Backend) -> list[Job]:
    """A job per prompt; if one cannot start, the others are cancelled."""
    jobs: list[Job] = []
    try:
        for i in range(len(plan.prompts)):
            jobs.append(launch(plan, i, backend))
    except BaseException as error:
        for job in jobs:
            job.cancel()
        if isinstance(error, QueueFull):
            backend.counters["rejected"] += 1
            seconds = backend.config.retry_after
            raise APIError(503, f"the server is busy ({error}); retry in {seconds} s", None, "queue_full",
                           "server_error", {"Retry-After": str(seconds)}) from None
        raise
    return jobs


async def collect(job: Job, backend: Backend, clock: TokenClock) -> list[Completion]:
    done: dict[int, Completion] = {}
    async for delta in job.aiter():
        if delta.completion is not None or delta.text:
            clock.tick((job.request_id, delta.sample_index))
        if delta.completion is not None:
            done[delta.sample_index] = delta.completion
            backend.counters["generated_tokens"] += len(delta.completion.token_ids)
    return [done[i] for i in sorted(done)]


async def collect_all(plan: Plan, jobs: list[Job], backend: Backend, clock: TokenClock
                      ) -> list[list[Completion]]:
    if plan.score_only:
        return [[Completion([], "", [], [], "length", Usage(len(ids), 0))] * plan.n for ids in plan.prompts]
    return list(await asyncio.gather(*(collect(job, backend, clock) for job in jobs)))


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def guarded(work, request: Request, jobs: list[Job], backend: Backend):
    """`work` under the request timeout, cancelled if the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    timeout = backend.config.request_timeout
    try:
        done, _ = await asyncio.wait({task, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        try:
            return task.result()
        except (ValueError, TypeError) as error:  # a bad request found by the worker (beam, ...)
            raise api_error(error) from None
    task.cancel()
    cancel(jobs, backend)
    if watcher in done:
        raise APIError(499, "client closed the request", None, "client_closed")
    backend.counters["timed_out"] += 1
    raise timeout_error(timeout)


def timeout_error(timeout: float) -> APIError:
    return APIError(504, f"the request did not finish within the server's timeout of {timeout:g} s", None,
                    "timeout", "timeout_error")


def cancel(jobs: list[Job], backend: Backend) -> None:
    for job in jobs:
        if not job.done:
            job.cancel()
            backend.counters["cancelled"] += 1


def sse(data: str) -> str:
    return f"data: {data}\n\n"


async def arrivals(jobs: list[Job]) -> AsyncIterator[list[tuple[int, Delta | Exception | None]]]:
    """The jobs' deltas as (job index, delta) in the batches they arrived in; a job's error and
    its end (None) come as items too. One job (most requests) is read directly: a token costs
    one wake-up of the stream's task; several are merged through a queue by a task each."""
    if len(jobs) == 1:
        try:
            async for batch in jobs[0].abatches():
                yield [(0, delta) for delta in batch]
        except Exception as error:  # noqa: BLE001 -- reported to the client as an error event
            yield [(0, error)]
        yield [(0, None)]
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, job: Job):
        try:
            async for batch in job.abatches():
                queue.put_nowait([(i, delta) for delta in batch])
        except Exception as error:  # noqa: BLE001
            queue.put_nowait([(i, error)])
        queue.put_nowait([(i, None)])

    tasks = [asyncio.ensure_future(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        while True:
            items = await queue.get()
            while not queue.empty():  # what arrived meanwhile goes out in one write
                items += queue.get_nowait()
            yield items
    finally:
        for task in tasks:
            task.cancel()


async def stream(plan: Plan, jobs: list[Job], rid: str, backend: Backend, clock: TokenClock
                 ) -> AsyncIterator[str]:
    """The jobs' deltas as OpenAI chunks, in arrival order (what arrived together in one write),
    then usage and [DONE]."""
    model = backend.models[plan.model]
    created = responses.now()
    sent: dict[int, list[int]] = {}  # choice -> its tokens so far (they place text offsets)
    text_chunk = responses.text_chunks(plan, rid, created)

    def chunk(index: int, text: str, completion: Completion | None = None, role: bool = False,
              logprobs=None) -> str:
        if completion is None and logprobs is None and not role:
            return sse(text_chunk(index, text))  # a token's chunk: the common case, made fast
        if plan.chat:
            delta = protocol.ChatDelta(role="assistant", content="") if role else \
                protocol.ChatDelta(content=text)
            return sse(responses.chat_chunk(plan, rid, created, index, delta, completion, logprobs))
        return sse(responses.completion_chunk(plan, rid, created, index, text, completion, logprobs))

    calls: dict[int, ToolCallStream] = {}  # choice -> its answer read for tool calls
    thinkers: dict[int, ThinkingStream] = {}  # choice -> its answer's thinking kept apart

    def delta_chunk(i: int, delta: Delta) -> str:
        index = i * plan.n + delta.sample_index
        logprobs = None
        if plan.logprobs is not None:
            before = sent.setdefault(index, [])
            logprobs = responses.delta_logprobs(plan, model, i, delta, before)
            before += delta.token_ids
        if not responses.reads_calls(plan) and plan.thinking is None:
            return chunk(index, delta.text, delta.completion, logprobs=logprobs)
        out, text, last = "", delta.text, delta.completion is not None
        if plan.thinking is not None:  # the thinking as reasoning_content, the rest as content
            thinker = thinkers.get(index) or thinkers.setdefault(index, ThinkingStream(plan.thinking))
            reasoning, text = thinker.feed(text)
            if last:
                more, rest = thinker.finish()
                reasoning, text = reasoning + more, text + rest
            if reasoning:
                thought = protocol.ChatDelta(reasoning_content=reasoning)
                out = sse(responses.chat_chunk(plan, rid, created, index, thought, logprobs=logprobs))
                logprobs = None  # sent with the reasoning
        made, pieces = [], []
        if responses.reads_calls(plan):
            reader = calls.get(index) or calls.setdefault(index, ToolCallStream(
                plan.tools.tools, plan.tools.format, plan.tools.forced, incremental=plan.tools.grammar))
            text, pieces = reader.feed(text)
            if last:
                rest, more, made = reader.finish()
                text, pieces = text + rest, pieces + more
        # calls made: "tool_calls", unless max_tokens cut the answer (its finished calls stand)
        reason = "tool_calls" if made and delta.completion.finish_reason != "length" else None
        if text or logprobs is not None or (last and not pieces):
            out += chunk(index, text, None if pieces or made else delta.completion, logprobs=logprobs)
        if pieces:
            tool_delta = protocol.ChatDelta(tool_calls=responses.tool_call_deltas(pieces))
            out += sse(responses.chat_chunk(plan, rid, created, index, tool_delta,
                                            delta.completion if last else None, reason=reason))  # fmt: skip
        elif last and made:  # every piece sent before: the finish alone
            out += sse(responses.chat_chunk(plan, rid, created, index, protocol.ChatDelta(), delta.completion,
                                            reason=reason))  # fmt: skip
        return out

    drawn: list[list[Completion]] = [[] for _ in jobs]
    deadline = asyncio.get_running_loop().time() + backend.config.request_timeout
    incoming = arrivals(jobs)
    try:
        for i in range(len(jobs)):
            echoed = None  # the echoed prompt's log-probs come with its text, as in the body
            if plan.echo and plan.logprobs is not None:
                ids = plan.prompts[i]
                lps, tops = await backend.run_blocking(responses.prompt_logprobs, model, ids, plan.logprobs)
                echoed = responses.legacy_logprobs(model, ids, lps, tops, plan.logprobs,
                                                   responses.text_offsets(model, ids, 0))
            for s in range(plan.n):
                if plan.chat or plan.echo:
                    yield chunk(i * plan.n + s, plan.prompt_texts[i] if plan.echo else "", role=plan.chat,
                                logprobs=echoed)
        remaining = len(jobs)
        while remaining:
            # The timeout covers this wait only: a timer per batch (asyncio.wait_for would
            # start a task per token), never a cancellation while the chunk is being sent.
            async with asyncio.timeout_at(deadline):
                items = await anext(incoming)
            out = []
            for i, item in items:
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    error = api_error(item) if isinstance(item, ValueError | TypeError) else APIError(
                        500, f"internal error: {item}", None, "internal_error", "server_error")
                    yield "".join(out) + sse(json.dumps(error.body()))
                    return
                elif item.completion is not None or item.text:
                    clock.tick((i, item.sample_index))
                    if item.completion is not None:
                        drawn[i].append(item.completion)
                        backend.counters["generated_tokens"] += len(item.completion.token_ids)
                    out.append(delta_chunk(i, item))
            if out:
                yield "".join(out)
        if plan.include_usage:
            yield sse(responses.usage_chunk(plan, rid, created, drawn))
        yield sse("[DONE]")
    except TimeoutError:
        backend.counters["timed_out"] += 1
        yield sse(json.dumps(timeout_error(backend.config.request_timeout).body()))
    finally:  # normal end, an error, a timeout, or the client went away (CancelledError)
        cancel(jobs, backend)
        await incoming.aclose()


def load_models(specs: list[str], dtype: str = "auto", device: str = "cpu") -> dict:
    """Served name -> model, from "NAME" (embedded or a directory) or "ALIAS=PATH" specs, each
    in `dtype` on `device` (`load_model`)."""
    return load_served(specs, dtype, device)[0]


def load_served(specs: list[str], dtype: str = "auto", device: str = "cpu"
                ) -> tuple[dict[str, LanguageModel], dict[str, str]]:
    """`load_models`, and each served name's source: "embedded" or its directory's full path."""
    from decodekit.models.registry import embedded_models, load_model

    models, sources = {}, {}
    for spec in specs:
        alias, _, path = spec.partition("=")
        if not path or "/" in alias:
            alias, path = "", spec
        model = load_model(path, dtype=dtype, device=device)
        name = alias or (spec if "/" not in spec else model.name)
        if name in models:
            raise ValueError(f"model name {name!r} is given twice; use ALIAS=PATH to rename one")
        models[name] = model
        sources[name] = "embedded" if path in embedded_models() else str(Path(path).expanduser().resolve())
    return models, sources


def directory_aliases(sources: dict[str, str]) -> dict[str, str]:
    """Each directory's full path -> the (first) model served from it: a request may name it so."""
    aliases: dict[str, str] = {}
    for name, source in sources.items():
        if source != "embedded":
            aliases.setdefault(source, name)
    return aliases


class ServerThread:
    """The app under uvicorn in a background thread, on loopback (tests, `bench server`).

    with ServerThread(backend) as server: ... server.url ...    (port 0: a free port)
    """

    def __init__(self, backend: Backend, host: str = "127.0.0.1", port: int = 0):
        uvicorn = require("uvicorn", "server", "the server")

        config = uvicorn.Config(create_app(backend, host), host=host, port=port, log_level="warning",
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="decodekit-server", daemon=True)
        self.host = host

    def __enter__(self) -> ServerThread:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server failed to start")
            self.thread.join(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def serve(backend: Backend, host: str = "127.0.0.1", port: int = 8000) -> None:
    """`decodekit serve`: answer until interrupted (the CLI loads the models: `load_models`)."""
    uvicorn = require("uvicorn", "server", "the server")
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again, whose default
    # action ends the process with status 143: after a finished shutdown, exit 0 instead.
    previous = signal.signal(signal.SIGTERM, _exit_after_shutdown)
    try:
        uvicorn.run(create_app(backend, host), host=host, port=port, log_level="info")
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_after_shutdown(signum, frame) -> None:
    raise SystemExit(0)
