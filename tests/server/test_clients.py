"""What real clients send (issue 38), taken as vLLM takes it: unknown body keys ignored and
named in X-Ignored-Fields (its_hub sends `extra_body` and vLLM's own keys to any server),
max_tokens beyond the context shortened to fit (optillm asks for 4096 on every model),
both refusable (`strict_fields`, `strict_max_tokens`); `--chat-template`; and constrained
output on every shipped model, with a clear server error for a tokenizer llguidance cannot
read."""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import pytest

from decodekit.server.app import ServerThread
from decodekit.server.backend import Backend, ServerConfig

LONG = [5] * 500  # 500 token ids: 390 more would overflow the 512 context


@pytest.fixture(scope="module")
def strict(server_models):
    config = ServerConfig(max_tokens=400, kv_bytes=8 * 2**20, strict_fields=True, strict_max_tokens=True)
    with ServerThread(Backend({"tiny": server_models["tiny"]}, config)) as thread:
        yield thread.url


def test_unknown_fields_are_ignored_and_named(server):
    thread, _ = server
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "extra_body": {"include_stop_str_in_output": False}, "include_stop_str_in_output": False}
    answer = httpx.post(thread.url + "/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.headers["X-Ignored-Fields"] == "extra_body, include_stop_str_in_output"
    typo = {"model": "tiny", "prompt": "a", "max_tokens": 2, "stream": True, "temprature": 0.5}
    streamed = httpx.post(thread.url + "/v1/completions", json=typo, timeout=60)
    assert streamed.status_code == 200 and streamed.headers["X-Ignored-Fields"] == "temprature"
    plain = httpx.post(thread.url + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2})
    assert plain.status_code == 200 and "X-Ignored-Fields" not in plain.headers
    tools = httpx.post(thread.url + "/v1/completions", json={"model": "tiny", "prompt": "a", "tools": []})
    assert tools.status_code == 400 and tools.json()["error"]["param"] == "tools"  # never silently dropped


@pytest.mark.parametrize("stream", [False, True])
def test_ignored_fields_beyond_latin1_or_with_control_characters_are_named_escaped(server, stream):
    """A header value is latin-1 without control characters: an unknown key beyond latin-1
    got a 500 (UnicodeEncodeError, found by schemathesis, issue 37), and one with CR LF would
    have ended the header; the names are escaped as JSON strings are."""
    thread, _ = server
    body = {"model": "tiny", "prompt": "a", "max_tokens": 2, "stream": stream, "\u00d3\U00012d6c\u00e9": 1,
            "a\r\nSet-Cookie: x": 2}
    answer = httpx.post(thread.url + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.headers["X-Ignored-Fields"] == "\\u00d3\\ud80b\\udd6c\\u00e9, a\\r\\nSet-Cookie: x"
    assert "set-cookie" not in answer.headers


def test_strict_fields_keep_openais_400(strict):
    document = httpx.get(strict + "/openapi.json").json()
    assert document["components"]["schemas"]["CompletionRequest"]["additionalProperties"] is False
    answer = httpx.post(strict + "/v1/completions", json={"model": "tiny", "prompt": "a", "temprature": 0.5})
    assert answer.status_code == 400
    assert answer.json()["error"] | {"message": None} == {"message": None, "type": "invalid_request_error",
                                                          "param": "temprature", "code": "unknown_parameter"}


def test_max_tokens_beyond_the_context_is_shortened_to_fit(server):
    thread, _ = server
    body = {"model": "tiny", "prompt": LONG, "max_tokens": 390, "ignore_eos": True, "temperature": 0}
    answer = httpx.post(thread.url + "/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    choice, usage = answer.json()["choices"][0], answer.json()["usage"]
    assert choice["finish_reason"] == "length" and usage == {"prompt_tokens": 500, "completion_tokens": 12,
                                                             "total_tokens": 512}


def test_max_tokens_above_the_bound_is_shortened_where_the_context_limits_it(server):
    thread, _ = server  # bound 400, context 512: optillm's self_consistency asks for 4096
    body = {"model": "tiny", "prompt": LONG, "max_tokens": 4096, "ignore_eos": True, "temperature": 0}
    answer = httpx.post(thread.url + "/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 12
    assert answer.json()["choices"][0]["finish_reason"] == "length"
    body = {"model": "tiny", "prompt": "a", "max_tokens": 401}
    short = httpx.post(thread.url + "/v1/completions", json=body)
    assert short.status_code == 400  # 511 tokens fit: the bound, not the context, limits this one
    assert "max_tokens must be <= 400 (this server's bound), got 401" in short.json()["error"]["message"]


def test_strict_max_tokens_keeps_the_refusal(strict):
    answer = httpx.post(strict + "/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 390})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    assert "max_tokens must be <= 12, got 390" in error["message"]


def test_a_chat_template_per_served_model(server_models):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}|"
    model = server_models["tiny"]
    backend = Backend({"tiny": model, "tiny-2": server_models["tiny-2"]}, ServerConfig(kv_bytes=8 * 2**20),
                      chat_templates={"tiny": template})
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with ServerThread(backend) as thread:
        usage = {name: httpx.post(thread.url + "/v1/chat/completions", timeout=60, json={
            "model": name, "messages": messages, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
            for name in ("tiny", "tiny-2")}
    assert usage["tiny"] == len(model.encode("<system>be brief<user>hi|"))
    assert usage["tiny-2"] == len(model.encode("SYSTEM: be brief\nUSER: hi\nASSISTANT:"))  # its own: plain
    with pytest.raises(ValueError, match=r"chat templates name models that are not served: \['nope'\]"):
        Backend({"tiny": model}, chat_templates={"nope": template})


def test_serve_chat_template_flag(tmp_path):
    from decodekit.cli.serve import chat_templates

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert chat_templates([str(path)], ["a", "b"]) == {"a": path.read_text(), "b": path.read_text()}
    assert chat_templates([f"b={path}"], ["a", "b"]) == {"b": path.read_text()}
    with pytest.raises(ValueError, match=r"cannot read .*nothing\.jinja .*MODEL one of \['a'\]"):
        chat_templates([str(tmp_path / "nothing.jinja")], ["a"])
    path.write_text("{% for %}")
    with pytest.raises(ValueError, match="not a Jinja template"):
        chat_templates([str(path)], ["a"])


@pytest.fixture(scope="module")
def shipped():
    """Every shipped language model with a tokenizer (the 5-gram has none)."""
    from decodekit.models.registry import load_model

    return {name: load_model(name) for name in ("shakespeare", "shakespeare-draft", "arith", "arith-small",
                                                "arith-large")}


# A schema each vocabulary can write: arith's 37 characters have no "{" or quote.
NUMBER = {"type": "integer", "minimum": 0, "maximum": 999}  # bounded: a greedy loop of digits ends
SCHEMAS = {"shakespeare": {"type": "object", "properties": {"a": NUMBER}, "required": ["a"],
                           "additionalProperties": False},
           "arith": NUMBER}


def test_response_format_gives_valid_json_on_every_shipped_model(shipped):
    with ServerThread(Backend(shipped, ServerConfig(kv_bytes=8 * 2**20))) as thread:
        for name in shipped:
            schema = SCHEMAS[name.split("-")[0]]
            fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
            body = {"model": name, "prompt": "Compute: 3+4*2=\n", "max_tokens": 40, "temperature": 0,
                    "response_format": fmt}
            answer = httpx.post(thread.url + "/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, (name, answer.text)
            choice = answer.json()["choices"][0]
            jsonschema.validate(json.loads(choice["text"]), schema)
            assert choice["finish_reason"] == "stop", (name, choice)
        body["response_format"]["json_schema"]["schema"] = SCHEMAS["shakespeare"]
        answer = httpx.post(thread.url + "/v1/completions", json={**body, "model": "arith"}, timeout=60)
        assert answer.status_code == 400 and "vocabulary cannot write what the grammar requires first" in \
            answer.json()["error"]["message"]


def test_a_tokenizer_llguidance_cannot_read_is_a_server_error(tmp_path):
    """arith's tokenizer as it was: character tokens and a Fuse decoder."""
    from decodekit.models.registry import load_model, resolve

    path = tmp_path / "fused"
    shutil.copytree(resolve("arith")[1], path)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    tokenizer["decoder"] = {"type": "Fuse"}
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    with ServerThread(Backend({"fused": load_model(path)}, ServerConfig(kv_bytes=8 * 2**20))) as thread:
        answer = httpx.post(thread.url + "/v1/completions", json={
            "model": "fused", "prompt": "1", "max_tokens": 2, "guided_regex": "[0-9]+"}, timeout=60)
    assert answer.status_code == 500
    error = answer.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "unsupported_tokenizer"
    assert error["param"] == "guided_regex"
    assert "llguidance cannot read its tokenizer.json (can't determine decoder type" in error["message"]
