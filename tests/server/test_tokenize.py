"""POST /tokenize and /detokenize (server/tokenize.py, vLLM's routes): the ids equal what the
completions and chat routes feed the model (their prompt_tokens and their token ids), text
past the context is counted not refused, the round trip gives the text back, and every bad
value is a 400 naming its field."""

from __future__ import annotations

import httpx
import pytest

MESSAGES = [{"role": "user", "content": "O Romeo, Romeo"}]


@pytest.fixture(scope="module")
def post(server):
    thread, _ = server

    def send(path: str, body: dict) -> httpx.Response:
        return httpx.post(thread.url + path, json=body, timeout=60)

    return send


def test_a_prompts_tokens_are_what_completions_feed_the_model(post, server):
    model = server[1].models["tiny"]
    answer = post("/tokenize", {"model": "tiny", "prompt": "ROMEO: But soft", "return_token_strs": True})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["tokens"] == list(model.encode("ROMEO: But soft")) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == model.max_context
    assert body["token_strs"] == [model.token_text(t) for t in body["tokens"]]
    usage = post("/v1/completions", {"model": "tiny", "prompt": "ROMEO: But soft", "max_tokens": 1}).json()
    assert usage["usage"]["prompt_tokens"] == body["count"]
    chat = post("/tokenize", {"model": "tiny", "messages": MESSAGES}).json()
    usage = post("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 1}).json()
    assert usage["usage"]["prompt_tokens"] == chat["count"] and "token_strs" in chat
    back = post("/detokenize", {"model": "tiny", "tokens": body["tokens"]}).json()
    assert back == {"prompt": model.decode(body["tokens"])} and back["prompt"].endswith("But soft")


def test_text_past_the_context_is_counted(post, server):
    model = server[1].models["tiny"]
    long = "ROMEO: But soft, what light " * 200
    body = post("/tokenize", {"model": "tiny", "prompt": long}).json()
    assert body["count"] == len(model.encode(long)) > body["max_model_len"]


def test_tools_reach_the_prompt_as_in_chat(post):
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    plain = post("/tokenize", {"model": "tiny", "messages": MESSAGES}).json()["count"]
    with_tools = post("/tokenize", {"model": "tiny", "messages": MESSAGES, "tools": [tool]}).json()["count"]
    assert with_tools > plain  # the plain template gets the tools as a system message


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"model": "tiny"}, "prompt"),
    ("/tokenize", {"model": "tiny", "prompt": "a", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"model": "tiny", "prompt": "a", "tools": []}, "tools"),
    ("/tokenize", {"model": "tiny", "prompt": 5}, "prompt"),
    ("/tokenize", {"model": "tiny", "prompt": "a", "add_special_tokens": False}, "add_special_tokens"),
    ("/tokenize", {"model": "nope", "prompt": "a"}, "model"),
    ("/detokenize", {"model": "tiny", "tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"model": "tiny", "tokens": [10**9]}, "tokens"),
    ("/detokenize", {"model": "tiny", "tokens": "12"}, "tokens"),
    ("/detokenize", {"model": "tiny"}, "tokens"),
])  # fmt: skip
def test_bad_values_are_400s_naming_the_field(post, path, body, param):
    answer = post(path, body)
    assert answer.status_code == (404 if param == "model" else 400), answer.text
    assert answer.json()["error"]["param"] == param
