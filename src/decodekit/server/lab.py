"""decodekit lab: a page at `/lab` that shows the algorithms work on a served model.

    GET  /lab                     the page (static files shipped in server/lab/; no key needed)
    GET  /lab/static/NAME         its script and style sheet
    GET  /lab/api/info            models, adapters and their SamplingParams fields (START values)
    POST /lab/api/sampler         the next-token distribution through each adapter; one step
    POST /lab/api/beam            beam search's tree of candidates
    POST /lab/api/tree            a tree meta-generator's nodes (step beam, DVTS, REBASE) on arith
    POST /lab/api/speculative     draft blocks under token and block verification
    POST /lab/api/votes           N samples, rewards, answers; majority, weighted vote, best-of-N

The JSON routes are guarded like the others (server/guard.py: API key, Host, Origin, JSON
body and its size); the page asks for the key and sends it. Each body is a JSON object; a bad
value is a 400 whose `param` names it. The views are computed in a thread
(server/lab_views.py). A model is a served one or, loaded on first use, an embedded one
(the arith views need `arith`, its reward models `arith-prm` and `arith-orm`).
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any, get_args, get_type_hints

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from decodekit.meta.tree import METHODS, TreeConfig
from decodekit.models.base import LanguageModel
from decodekit.params import DEFAULT_ORDER, NULLABLE_FIELDS, PRESETS, SamplingParams
from decodekit.sampling.adapters import ADAPTERS
from decodekit.server import lab_views as views
from decodekit.server.protocol import APIError
from decodekit.server.request_plan import api_error

STATIC = Path(__file__).parent / "lab"
FILES = {"lab.js": "text/javascript", "lab.css": "text/css"}
BODIES = tuple(f"/lab/api/{name}" for name in ("sampler", "beam", "tree", "speculative", "votes"))
LIBRARY_NAMES: dict[str, str] = {}  # a lab body names SamplingParams' fields as the library does
MAX_NEW_TOKENS = 128  # the lab shows every step: longer runs are not readable anyway
# The SamplingParams fields of each adapter (the page's editor; values are SamplingParams'),
# as each adapter declares them (sampling/adapters.py).
ADAPTER_FIELDS = {name: adapter.fields for name, adapter in ADAPTERS.items()}
_TYPES = get_type_hints(SamplingParams)
# The editor's numeric inputs, and the fields whose empty input means null (off): by type.
NULL_FIELDS = [f for fs in ADAPTER_FIELDS.values() for f in fs if f in NULLABLE_FIELDS]
NUMBER_FIELDS = [f for fs in ADAPTER_FIELDS.values() for f in fs if _TYPES[f] in (int, float)
                 or f in NULL_FIELDS and set(get_args(_TYPES[f])) <= {int, float, type(None)}]  # fmt: skip
# The sampler view's first chain: two active stages, so a first look shows the chain at work
# (SamplingParams' own defaults are all off: an empty chain; issue 26).
START = SamplingParams(temperature=0.8, top_p=0.95)


class LabModels:
    """Served models by name, and embedded ones (models, reward models) loaded on first use."""

    def __init__(self, served: dict[str, LanguageModel]):
        self.served = served
        self.loaded: dict[str, Any] = {}
        self.lock = threading.Lock()

    def names(self) -> list[str]:
        from decodekit.models.registry import embedded_models

        embedded = [n for n, e in embedded_models().items() if e.get("kind") != "reward"]
        return list(self.served) + [n for n in embedded if n not in self.served]

    def model(self, name: Any, field: str = "model") -> LanguageModel:
        if isinstance(name, str) and name in self.served:
            return self.served[name]
        if not isinstance(name, str) or name not in self.names():
            raise _bad(field, f"must be one of {self.names()}, got {name!r}")
        return self.load(name, lambda: _load_model(name))

    def load(self, key: str, build):
        with self.lock:  # one load per name, whatever the concurrent requests
            if key not in self.loaded:
                self.loaded[key] = build()
            return self.loaded[key]


def _load_model(name: str) -> LanguageModel:
    from decodekit.models.registry import load_model

    return load_model(name)


def _reward(kind: str):
    from decodekit.meta.tasks.arith import load_orm, load_prm

    return load_prm() if kind == "prm" else load_orm()


# -- body checks ---------------------------------------------------------------------------------


def _bad(name: str, message: str) -> APIError:
    return APIError(400, f"{name} {message}", name, "invalid_value")


def get_int(body: dict, name: str, default: int, low: int, high: int) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _bad(name, f"must be an integer in [{low}, {high}], got {value!r}")
    return value


def get_str(body: dict, name: str, default: str | None = None, choices: tuple[str, ...] = ()) -> str:
    value = body.get(name, default)
    if not isinstance(value, str) or not value or (choices and value not in choices):
        allowed = f"one of {list(choices)}" if choices else "a non-empty string"
        raise _bad(name, f"must be {allowed}, got {value!r}")
    return value


def get_question(body: dict) -> str:
    from decodekit.meta.tasks.arith import parse_question

    question = get_str(body, "question")
    try:
        parse_question(question)
    except ValueError as error:
        raise _bad("question", f"must be an arith question such as 17+4*3-8: {error}") from None
    return question


def get_params(body: dict, max_new_tokens: int | None = None, **defaults: Any) -> SamplingParams:
    """SamplingParams from body["params"] (an object of its fields), a seed of 0 unless given."""
    given = body.get("params", {})
    if not isinstance(given, dict):
        raise _bad("params", f"must be an object of SamplingParams fields, got {given!r:.80}")
    unknown = sorted(set(given) - set(SamplingParams.field_names()))
    if unknown:
        raise _bad("params", f"has unknown fields {unknown}; allowed: SamplingParams' fields")
    fields = {"seed": 0, **defaults, **given}
    if isinstance(fields.get("logit_bias"), dict):  # JSON object keys are strings
        try:
            fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
        except ValueError:
            raise _bad("logit_bias", f"keys must be token ids, got {list(fields['logit_bias'])}") from None
    if max_new_tokens is not None:
        fields["max_new_tokens"] = get_int(fields, "max_new_tokens", max_new_tokens, 1, MAX_NEW_TOKENS)
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as error:
        raise api_error(error, "params", names=LIBRARY_NAMES) from None


async def read_body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"the body is not valid JSON: {error}", None, "invalid_json") from None
    if not isinstance(body, dict):
        kind = type(body).__name__
        raise APIError(400, f"the body must be a JSON object, got {kind}", None, "invalid_json")
    return body


def bad_value(error: Exception, body: dict) -> APIError:
    """A library ValueError/TypeError as a 400 naming the body field its message starts with."""
    match = re.match(r"[a-z_]+", str(error))
    name = match.group(0) if match else ""
    if name in body:
        return APIError(400, str(error), name, "invalid_value")
    return api_error(error, names=LIBRARY_NAMES)


# -- routes --------------------------------------------------------------------------------------


def lab_router(backend) -> APIRouter:
    """The page and its JSON routes over `backend`'s models."""
    router = APIRouter(include_in_schema=False)
    models = LabModels(backend.models)
    max_n = min(backend.config.max_n, 64)

    async def run(body: dict, fn, *args):
        try:
            return await backend.run_blocking(fn, *args)
        except (ValueError, TypeError) as error:
            raise bad_value(error, body) from None

    @router.get("/lab")
    async def page():
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @router.get("/lab/static/{name}")
    async def static(name: str):
        if name not in FILES:
            raise APIError(404, f"no lab file {name!r}", None, "not_found", "not_found_error")
        return FileResponse(STATIC / name, media_type=FILES[name])

    @router.get("/lab/api/info")
    async def info():
        fields = {name: {f: getattr(START, f) for f in fs} for name, fs in ADAPTER_FIELDS.items()}
        return {"models": models.names(), "served": list(backend.models), "adapters": list(DEFAULT_ORDER),
                "fields": fields, "numbers": NUMBER_FIELDS, "nullable": NULL_FIELDS,
                "presets": {name: {"temperature": t, "top_p": p} for name, (t, p) in PRESETS.items()},
                "tree_methods": list(METHODS), "max_n": max_n,
                "max_new_tokens": MAX_NEW_TOKENS}

    @router.post("/lab/api/sampler")
    async def sampler(request: Request):
        body = await read_body(request)
        model = await run(body, models.model, body.get("model"))
        params = get_params(body)
        choose = body.get("choose")
        if choose not in (None, "sample") and (isinstance(choose, bool) or not isinstance(choose, int)):
            raise _bad("choose", f"must be \"sample\", a token id or null, got {choose!r}")
        generated = body.get("generated", [])
        return await run(body, views.sampler_view, model, get_str(body, "prompt"), params, generated,
                         get_int(body, "top", 12, 1, 100), choose)

    @router.post("/lab/api/beam")
    async def beam(request: Request):
        body = await read_body(request)
        model = await run(body, models.model, body.get("model"))
        params = get_params(body, max_new_tokens=12)
        alpha = body.get("length_penalty", 1.0)
        if isinstance(alpha, bool) or not isinstance(alpha, int | float):
            raise _bad("length_penalty", f"must be a number, got {alpha!r}")
        early = body.get("early_stopping", True)
        if not isinstance(early, bool):
            raise _bad("early_stopping", f"must be true or false, got {early!r}")
        return await run(body, views.beam_view, model, get_str(body, "prompt"), params,
                         get_int(body, "num_beams", 3, 1, max_n), float(alpha), early)

    @router.post("/lab/api/tree")
    async def tree(request: Request):
        body = await read_body(request)
        model = await run(body, models.model, body.get("model", "arith"))
        prm = await run(body, models.load, "arith-prm", lambda: _reward("prm"))
        params = get_params(body, max_new_tokens=24, temperature=1.0)
        try:
            config = TreeConfig(width=get_int(body, "width", 2, 1, max_n),
                                max_depth=get_int(body, "max_depth", 6, 1, 16),
                                tau=body.get("tau", 0.2))
        except ValueError as error:
            raise bad_value(error, body) from None
        return await run(body, views.tree_view, model, prm, get_question(body),
                         get_str(body, "method", "beam", METHODS), get_int(body, "n", 4, 1, max_n), config,
                         params)

    @router.post("/lab/api/speculative")
    async def speculative(request: Request):
        body = await read_body(request)
        target = await run(body, models.model, body.get("model"))
        draft_name = body.get("draft", "auto")
        if draft_name == "auto":
            draft_name = f"{target.name}-draft"
        draft = draft_name if draft_name == "prompt-lookup" else await run(body, models.model, draft_name,
                                                                           "draft")
        params = get_params(body, max_new_tokens=24)
        return await run(body, views.speculative_view, target, draft, get_str(body, "prompt"), params,
                         get_int(body, "num_draft_tokens", 4, 1, 16),
                         get_str(body, "follow", "block", tuple(views.VERIFIERS)))

    @router.post("/lab/api/votes")
    async def votes(request: Request):
        body = await read_body(request)
        model = await run(body, models.model, body.get("model", "arith"))
        orm = await run(body, models.load, "arith-orm", lambda: _reward("orm"))
        params = get_params(body, max_new_tokens=64, temperature=1.0)
        return await run(body, views.votes_view, model, orm, get_question(body),
                         get_int(body, "n", 8, 1, max_n), params)

    return router
