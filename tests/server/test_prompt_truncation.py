"""Prompts longer than the context (issue 38: optillm's `bon` and `moa` feed earlier answers back
as prompts): vLLM's per-request `truncate_prompt_tokens` keeps a prompt's last k tokens, and
`serve --truncate-prompts` cuts any prompt that does not fit to its last context - 1 tokens.
Either way usage counts the tokens kept and `X-Prompt-Tokens-Dropped` names those cut; greedy
output equals that of the explicitly cut prompt. Without them a long prompt is a 400 naming its
length and the context, on the shipped models (shakespeare: 512 tokens, arith: 256)."""

from __future__ import annotations

import pytest

from decodekit.server.protocol import ChatMessage
from decodekit.server.request_plan import chat_text, template_ids

LONG = {"shakespeare": "ROMEO: What light through yonder window breaks? It is the east.\n" * 30,
        "arith": "Compute: 12+34*2=\n80\n" * 16}


@pytest.fixture(scope="module")
def shipped():
    from decodekit.models.registry import load_model

    return {name: load_model(name) for name in LONG}


def client_over(models, **config):
    from fastapi.testclient import TestClient

    from decodekit.server.app import create_app
    from decodekit.server.backend import Backend, ServerConfig

    backend = Backend(models, ServerConfig(kv_bytes=8 * 2**20, **config))
    return TestClient(create_app(backend), base_url="http://127.0.0.1")


@pytest.fixture(scope="module")
def plain(shipped):
    with client_over(shipped) as client:
        yield client


@pytest.fixture(scope="module")
def truncating(shipped):
    with client_over(shipped, truncate_prompts=True) as client:
        yield client


def greedy(client, name: str, prompt, **fields):
    body = {"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **fields}
    return client.post("/v1/completions", json=body)


@pytest.mark.parametrize("name", list(LONG))
def test_truncate_prompt_tokens_equals_the_explicitly_cut_prompt(plain, shipped, name):
    model = shipped[name]
    ids = model.encode(LONG[name])
    assert len(ids) >= model.max_context  # the whole prompt does not fit
    for k in (1, 37, model.max_context - 8):
        cut = greedy(plain, name, LONG[name], truncate_prompt_tokens=k)
        assert cut.status_code == 200, cut.text
        assert cut.headers["X-Prompt-Tokens-Dropped"] == str(len(ids) - k)
        explicit = greedy(plain, name, ids[-k:])
        assert "X-Prompt-Tokens-Dropped" not in explicit.headers
        assert cut.json()["usage"] == explicit.json()["usage"]
        assert cut.json()["usage"]["prompt_tokens"] == k
        assert cut.json()["choices"][0]["token_ids"] == explicit.json()["choices"][0]["token_ids"]


def test_truncate_prompt_tokens_in_chat_and_a_prompt_shorter_than_k(plain, shipped):
    model, messages = shipped["shakespeare"], [{"role": "user", "content": LONG["shakespeare"]}]
    text, templated = chat_text(model, [ChatMessage.model_validate(m) for m in messages])
    ids = template_ids(model, text) if templated else model.encode(text)
    body = {"model": "shakespeare", "messages": messages, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "truncate_prompt_tokens": 100}
    chat = plain.post("/v1/chat/completions", json=body)
    assert chat.status_code == 200, chat.text
    assert chat.headers["X-Prompt-Tokens-Dropped"] == str(len(ids) - 100)
    explicit = greedy(plain, "shakespeare", ids[-100:], max_tokens=6)
    assert chat.json()["choices"][0]["message"]["content"] == explicit.json()["choices"][0]["text"]
    assert chat.json()["usage"]["prompt_tokens"] == 100
    short = greedy(plain, "shakespeare", "ROMEO:", truncate_prompt_tokens=-1)  # -1: the context
    assert short.status_code == 200 and "X-Prompt-Tokens-Dropped" not in short.headers


def test_a_prompt_past_the_context_is_a_400_naming_its_length_and_the_context(plain, shipped):
    """Not a 500: optillm's proxy answers 500 for any upstream error, this 400 included."""
    for name, model in shipped.items():
        answer = greedy(plain, name, LONG[name])
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
        assert error["message"] == (f"prompt has {len(model.encode(LONG[name]))} tokens; the model's context "
                                    f"is {model.max_context}, so a prompt must have fewer tokens than that")
    whole = greedy(plain, "arith", LONG["arith"], truncate_prompt_tokens=-1)  # keeps the context: no room
    assert whole.status_code == 400 and "prompt has 256 tokens" in whole.json()["error"]["message"]


@pytest.mark.parametrize(("value", "message"), [
    (0, "truncate_prompt_tokens must be an integer >= 1, or -1 (the model's context), got 0"),
    (-2, "truncate_prompt_tokens must be null or an integer >= -1, got -2"),
    (257, "truncate_prompt_tokens must be <= the model's context of 256 tokens (or -1), got 257"),
    (2.5, "truncate_prompt_tokens must be null or an integer >= -1, got 2.5"),
    ("3", "truncate_prompt_tokens must be null or an integer >= -1, got '3'"),
])
def test_bad_truncate_prompt_tokens_are_a_400_naming_the_value(plain, value, message):
    for path, body in (("/v1/completions", {"prompt": "1+1="}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1+1="}]})):
        answer = plain.post(path, json={"model": "arith", "truncate_prompt_tokens": value, **body})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "truncate_prompt_tokens"
        assert answer.json()["error"]["message"] == message


@pytest.mark.parametrize("name", list(LONG))
def test_truncate_prompts_cuts_what_does_not_fit_to_the_context_less_one(truncating, plain, shipped, name):
    model = shipped[name]
    ids, keep = model.encode(LONG[name]), model.max_context - 1
    cut = greedy(truncating, name, LONG[name], max_tokens=256)
    assert cut.status_code == 200, cut.text
    assert cut.headers["X-Prompt-Tokens-Dropped"] == str(len(ids) - keep)
    choice = cut.json()["choices"][0]
    assert cut.json()["usage"]["prompt_tokens"] == keep and choice["finish_reason"] == "length"
    explicit = greedy(plain, name, ids[-keep:], max_tokens=1)
    assert choice["token_ids"] == explicit.json()["choices"][0]["token_ids"]
    fits = greedy(truncating, name, ids[:20])
    assert "X-Prompt-Tokens-Dropped" not in fits.headers
    assert fits.json()["choices"] == greedy(plain, name, ids[:20]).json()["choices"]
    # one header value per prompt, in order; a request's own truncate_prompt_tokens wins
    several = greedy(truncating, name, [ids, ids[:20]])
    assert several.status_code == 200, several.text
    assert several.headers["X-Prompt-Tokens-Dropped"] == f"{len(ids) - keep}, 0"
    own = greedy(truncating, name, LONG[name], truncate_prompt_tokens=30)
    assert own.json()["usage"]["prompt_tokens"] == 30


def test_truncate_prompts_in_chat_and_streams(truncating, shipped):
    """optillm's `moa` critique: a conversation past the context, max_tokens 512."""
    messages = [{"role": "user", "content": LONG["shakespeare"]}, {"role": "assistant", "content": "No."},
                {"role": "user", "content": "Critique the answer above."}]
    body = {"model": "shakespeare", "messages": messages, "max_tokens": 512, "temperature": 0.1}
    answer = truncating.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == 511
    assert int(answer.headers["X-Prompt-Tokens-Dropped"]) > 0
    with truncating.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as streamed:
        assert streamed.status_code == 200
        assert streamed.headers["X-Prompt-Tokens-Dropped"] == answer.headers["X-Prompt-Tokens-Dropped"]
        assert "data: [DONE]" in streamed.read().decode()
