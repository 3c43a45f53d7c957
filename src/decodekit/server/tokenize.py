"""POST /tokenize and POST /detokenize (vLLM's routes): what a request's text is in tokens.

`/tokenize` gives the ids a `/v1/completions` request's `prompt` or a `/v1/chat/completions`
request's `messages` (with its `tools` and `chat_template_kwargs`) would feed the model: the
prompt through the model's own encoding, the conversation through the same chat template and
tool instruction as chat (request_plan.py `chat_text`). Unlike those, a text longer than the
context is counted, not refused, so a client can find out by how much it is too long
(`count` beside `max_model_len`). `/detokenize` gives the text of ids, refusing ids outside
the vocabulary. Every bad value is a 400 naming its field.
"""

from __future__ import annotations

from decodekit.conversation import template_source, tool_use
from decodekit.server import protocol as p
from decodekit.server.backend import Backend
from decodekit.server.protocol import APIError
from decodekit.server.request_plan import chat_fields, chat_text, served_name, template_ids


def tokenize(req: p.TokenizeRequest, backend: Backend) -> p.TokenizeResponse:
    name = served_name(req.model, backend)
    model = backend.models[name]
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give one of prompt (a string) or messages", "prompt", "invalid_value")
    if model.tokenizer is None:
        raise APIError(400, f"model {name!r} has no tokenizer, so it cannot tokenize text", "model")
    if req.prompt is not None:
        if req.tools is not None or req.chat_template_kwargs is not None:
            field = "tools" if req.tools is not None else "chat_template_kwargs"
            raise APIError(400, f"{field} goes with messages, not prompt", field, "invalid_value")
        ids = list(model.encode(req.prompt))
    else:
        template = backend.chat_templates.get(name)
        listed = None if req.tools is None else [tool.model_dump() for tool in req.tools]
        tools = chat_fields(tool_use, listed, None, True, template_source(model, template))
        text, templated = chat_text(model, req.messages, template, tools, req.chat_template_kwargs)
        ids = template_ids(model, text, whole=True) if templated else list(model.encode(text))
    strs = [model.token_text(t) for t in ids] if req.return_token_strs else None
    return p.TokenizeResponse(count=len(ids), max_model_len=model.max_context, tokens=ids, token_strs=strs)


def detokenize(req: p.DetokenizeRequest, backend: Backend) -> p.DetokenizeResponse:
    name = served_name(req.model, backend)
    model = backend.models[name]
    bad = [t for t in req.tokens if not 0 <= t < model.vocab_size]
    if bad:
        raise APIError(400, f"tokens must be ids in [0, {model.vocab_size}), got {bad[:5]}", "tokens",
                       "invalid_value")  # fmt: skip
    if model.tokenizer is None:
        raise APIError(400, f"model {name!r} has no tokenizer, so it cannot detokenize", "model")
    return p.DetokenizeResponse(prompt=model.decode(list(req.tokens)))
