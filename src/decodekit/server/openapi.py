"""The server's OpenAPI document: request bodies, response bodies and error answers.

The routes read their bodies themselves (strictly, off the event loop: app.py), so FastAPI
cannot see their models; this module declares them: each POST's request body is its
pydantic model (protocol.py), each route's 200 its response model (a stream's
`text/event-stream` beside it), and every error it may answer the one error body. A schema
fuzzer (schemathesis, scripts/fuzz_server.sh) and generated clients use it.

The published request schemas list the fields the server knows: OpenAI's, decodekit's
strategy fields and the sampling extensions (extensions.py: typed, bounded and described
from SamplingParams). With `strict_fields` they close the objects (`additionalProperties:
false`): the parser accepts exactly these and answers 400 to any other key; by default the
server ignores other keys (naming them in X-Ignored-Fields), and the schema leaves them open.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from decodekit.server import protocol as p
from decodekit.server.extensions import RENAMED
from decodekit.server.guard import OPEN
from decodekit.server.request_plan import CROSS_FIELD_RULES

REF = "#/components/schemas/{model}"
ERRORS = {
    400: "malformed body or invalid value (the error's param names the field)",
    401: "missing or wrong API key (--api-key)",
    403: "Host or Origin not allowed (--allowed-hosts, --cors-origin)",
    404: "unknown model or route",
    405: "method not allowed (the Allow header lists the allowed ones)",
    413: "request body larger than --max-body-mb",
    415: "request body not JSON",
    503: "the queue is full (Retry-After)",
    504: "the request outlived the server's timeout",
}
# Which errors each route may answer, besides the guard's (403; 401 but on /health).
ROUTE_ERRORS = {
    ("get", "/health"): (405,),
    ("get", "/metrics"): (405,),
    ("get", "/v1/models"): (405,),
    ("get", "/v1/models/{name}"): (404, 405),
    ("post", "/v1/completions"): (400, 404, 405, 413, 415, 503, 504),
    ("post", "/v1/chat/completions"): (400, 404, 405, 413, 415, 503, 504),
    ("post", "/tokenize"): (400, 404, 405, 413, 415),
    ("post", "/detokenize"): (400, 404, 405, 413, 415),
}
BODIES = {
    ("post", "/v1/completions"): (p.CompletionRequest, p.CompletionResponse),
    ("post", "/v1/chat/completions"): (p.ChatRequest, p.ChatResponse),
    ("get", "/v1/models"): (None, p.ModelList),
    ("get", "/v1/models/{name}"): (None, p.ModelCard),
    ("post", "/tokenize"): (p.TokenizeRequest, p.TokenizeResponse),
    ("post", "/detokenize"): (p.DetokenizeRequest, p.DetokenizeResponse),
}


# One server-sent event of a stream (OpenAPI before 3.2: a stream's `schema` describes each event).
EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a chunk (JSON: completion or chat chunk, or an error body) "
                                              "or [DONE]"},
    "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body (protocol.error_body)."""

    error: ErrorDetail


def add_schema(components: dict, model: type[BaseModel], mode: str = "validation") -> dict:
    """Put `model` (and the models it uses) in `components`; its reference."""
    schema = model.model_json_schema(ref_template=REF, mode=mode)
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": REF.format(model=model.__name__)}


def constrain_request(schema: dict, models: list[str], config) -> None:
    """A request's schema lists every key the parser accepts and no other, the served models and
    the single-field bounds (request_plan.py, SamplingParams); the checks across fields stay 400s, said
    in their fields' descriptions (request_plan.py `CROSS_FIELD_RULES`)."""
    schema["additionalProperties"] = not config.strict_fields
    properties = schema["properties"]
    properties["model"]["enum"] = models
    bounds = {"temperature": {"minimum": 0}, "top_p": {"exclusiveMinimum": 0, "maximum": 1},
              "n": {"minimum": 1, "maximum": config.max_n},
              "max_tokens": {"minimum": 0, "maximum": config.max_tokens},
              "max_completion_tokens": {"minimum": 0, "maximum": config.max_tokens},
              "logprobs": {"minimum": 0, "maximum": 20}, "top_logprobs": {"minimum": 0, "maximum": 20},
              "presence_penalty": {"minimum": -2, "maximum": 2},
              "frequency_penalty": {"minimum": -2, "maximum": 2}}
    for name, bound in bounds.items():
        for option in properties.get(name, {}).get("anyOf", [properties.get(name, {})]):
            if option.get("type") in ("integer", "number"):
                option.update(bound)
    if "messages" in properties:
        properties["messages"]["minItems"] = 1
    for name, rule in CROSS_FIELD_RULES.items():  # checked by request_plan.py, said here
        if name in properties:
            described = properties[name].get("description")
            properties[name]["description"] = f"{described} {rule}" if described else rule
    # a field and its vLLM name (min_tokens, min_new_tokens): one or the other
    schema["not"] = {"anyOf": [{"required": [alias, name]} for alias, name in RENAMED.items()]}
    for option in properties.get("prompt", {}).get("anyOf", []):  # a prompt has at least one token
        option.update({"minLength": 1} if option["type"] == "string" else {"minItems": 1})
        if option["type"] == "array" and option["items"].get("type") == "string":
            option["items"]["minLength"] = 1
        if option["type"] == "array" and option["items"].get("type") == "array":  # [[]]: no tokens
            option["items"]["minItems"] = 1


def json_content(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def openapi_document(app, models: Iterable[str], config) -> dict[str, Any]:
    """The app's OpenAPI document, for a server of `models` under `config` (its ServerConfig;
    cached on the app, as FastAPI does)."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="OpenAI-compatible completions over decodekit's decoders")
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    error = add_schema(components, ErrorResponse)
    doc["paths"]["/v1/models/{name}"]["get"]["parameters"][0]["schema"]["examples"] = list(models)
    for (method, path), statuses in ROUTE_ERRORS.items():
        operation = doc["paths"][path][method]
        request, response = BODIES.get((method, path), (None, None))
        if request is not None:
            schema = add_schema(components, request)
            operation["requestBody"] = {"required": True, "content": json_content(schema)}
            constrain_request(components[request.__name__], list(models), config)
            if request.model_config.get("extra") == "forbid":  # /tokenize, /detokenize: no other keys
                components[request.__name__]["additionalProperties"] = False
        answers = operation["responses"] = {}
        ok = {"description": "OK", "content": json_content(
            add_schema(components, response, "serialization") if response else {})}
        if path == "/metrics":  # Prometheus' text format
            ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
        if path.endswith("completions"):  # stream: true
            ok["content"]["text/event-stream"] = {"schema": EVENT}
        answers["200"] = ok
        guard = {403} if path in OPEN else {401, 403}
        for status in sorted({*guard, *statuses}):
            answers[str(status)] = {"description": ERRORS[status], "content": json_content(error)}
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    app.openapi_schema = doc
    return doc
