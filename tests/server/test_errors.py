"""Bad input gets the documented 4xx with an OpenAI-style body naming the field, a full queue
gets 503 with Retry-After, a slow request 504, and the server keeps answering."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 4}
CHAT_OK = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def body(**changes):
    return {**OK, **changes}


def chat_body(**changes):
    return {**CHAT_OK, **changes}


# An unknown key (temprature) and a max_tokens past the context are taken as vLLM takes them,
# unless the server is strict (test_clients.py).
# (path, body: dict or raw bytes, status, param)
BAD = [
    (COMPLETIONS, b'{"model": "tiny", "prompt": ', 400, None),
    (COMPLETIONS, b"", 400, None),
    (COMPLETIONS, b"[1, 2]", 400, None),
    (COMPLETIONS, b"hello", 400, None),
    (COMPLETIONS, {"prompt": "x"}, 400, "model"),
    (COMPLETIONS, {"model": "tiny"}, 400, "prompt"),
    (COMPLETIONS, body(model="gpt-17"), 404, "model"),
    (COMPLETIONS, body(temperature=-1), 400, "temperature"),
    (COMPLETIONS, body(temperature="hot"), 400, "temperature"),
    (COMPLETIONS, body(top_p=1.5), 400, "top_p"),
    (COMPLETIONS, body(top_p=0), 400, "top_p"),
    (COMPLETIONS, body(n=0), 400, "n"),
    (COMPLETIONS, body(n=1000), 400, "n"),
    (COMPLETIONS, body(n=True), 400, "n"),
    (COMPLETIONS, body(max_tokens=0), 400, "max_tokens"),
    (COMPLETIONS, body(max_tokens=1.5), 400, "max_tokens"),
    (COMPLETIONS, body(max_tokens=100000), 400, "max_tokens"),
    (COMPLETIONS, body(prompt=[5] * 600), 400, "prompt"),
    (COMPLETIONS, body(prompt=[99999]), 400, "prompt"),
    (COMPLETIONS, body(prompt=""), 400, "prompt"),
    (COMPLETIONS, body(prompt=[1, "a"]), 400, "prompt"),
    (COMPLETIONS, body(logit_bias={"abc": 1}), 400, "logit_bias"),
    (COMPLETIONS, body(logit_bias={"5": 500}), 400, "logit_bias"),
    (COMPLETIONS, body(logit_bias={"99999": 1}), 400, "logit_bias"),
    (COMPLETIONS, body(stop=[""]), 400, "stop"),
    (COMPLETIONS, body(seed=-1), 400, "seed"),
    (COMPLETIONS, body(presence_penalty=3), 400, "presence_penalty"),
    (COMPLETIONS, body(logprobs=50), 400, "logprobs"),
    (COMPLETIONS, body(suffix="x"), 400, "suffix"),
    (COMPLETIONS, body(top_k=-5), 400, "top_k"),
    (COMPLETIONS, body(min_p="much"), 400, "min_p"),
    (COMPLETIONS, body(preset="poetry"), 400, "preset"),
    (COMPLETIONS, body(preset=3), 400, "preset"),
    (COMPLETIONS, body(response_format={"type": "xml"}), 400, "response_format"),
    (COMPLETIONS, body(response_format={"type": "json_schema",
                                        "json_schema": {"schema": {"type": "nonsense"}}}), 400,
     "response_format"),
    (COMPLETIONS, body(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400,
     "response_format"),
    (COMPLETIONS, body(guided_regex="("), 400, "guided_regex"),
    (COMPLETIONS, body(guided_regex="a+", guided_choice=["b"]), 400, "guided_regex"),
    (COMPLETIONS, body(best_of=1, n=2), 400, "best_of"),
    (COMPLETIONS, body(best_of=4, scorer="oracle"), 400, "scorer"),
    (COMPLETIONS, body(best_of=4, vote="majority", n=2), 400, "n"),
    (COMPLETIONS, body(best_of=4, vote="majority", answer_regex="("), 400, "answer_regex"),
    (COMPLETIONS, body(best_of=4, stream=True), 400, "stream"),
    (COMPLETIONS, body(vote="plurality", best_of=3), 400, "vote"),
    (COMPLETIONS, body(use_beam_search=True, stop=["x"]), 400, "stop"),
    (COMPLETIONS, body(use_beam_search=True, num_beams=2, n=3), 400, "n"),
    (COMPLETIONS, body(num_beams=2), 400, "num_beams"),
    (COMPLETIONS, body(draft_model="nope"), 404, "draft_model"),
    (COMPLETIONS, body(draft_model="tiny-2", num_draft_tokens=0), 400, "num_draft_tokens"),
    (COMPLETIONS, body(amateur_model="nope"), 404, "amateur_model"),
    (COMPLETIONS, body(amateur_model="tiny-2", contrastive_alpha=2.0), 400, "contrastive_alpha"),
    (COMPLETIONS, body(contrastive_alpha=0.5), 400, "amateur_model"),
    (COMPLETIONS, body(stop=[1, 2]), 400, "stop"),
    (COMPLETIONS, body(echo=True, max_tokens=-1), 400, "max_tokens"),
    (CHAT, {"model": "tiny"}, 400, "messages"),
    (CHAT, chat_body(messages=[]), 400, "messages"),
    (CHAT, chat_body(messages=[{"role": "wizard", "content": "x"}]), 400, "messages"),
    (CHAT, chat_body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, "messages"),
    (CHAT, chat_body(top_logprobs=2), 400, "top_logprobs"),
    (CHAT, chat_body(logprobs=True, top_logprobs=30), 400, "top_logprobs"),
    (CHAT, chat_body(max_completion_tokens=100000), 400, "max_completion_tokens"),
    (CHAT, chat_body(tools=[{"type": "function"}]), 400, "tools"),
    (CHAT, chat_body(model="nope"), 404, "model"),
]


@pytest.mark.parametrize(("path", "payload", "status", "param"), BAD,
                         ids=[f"{i}-{case[3]}" for i, case in enumerate(BAD)])
def test_bad_request_gets_an_openai_error_naming_the_field(server, path, payload, status, param):
    thread, _ = server
    if isinstance(payload, bytes):
        headers = {"Content-Type": "application/json"}
        response = httpx.post(thread.url + path, content=payload, headers=headers)
    else:
        response = httpx.post(thread.url + path, json=payload)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    if payload == body(prompt=[5] * 600):
        assert error["code"] == "context_length_exceeded"
    assert httpx.get(thread.url + "/health").status_code == 200  # still answering


def test_the_server_still_generates_after_the_suite(client):
    # (ignore_eos: an unseeded draw of the random model may pick EOS first, an empty answer)
    answer = client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=3, seed=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert answer.usage.completion_tokens == 3 and answer.choices[0].finish_reason == "length"


def test_unknown_route_is_an_openai_404(server):
    thread, _ = server
    response = httpx.get(thread.url + "/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"


def test_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="x", top_p=7)
    assert caught.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="none", messages=[{"role": "user", "content": "x"}])


@pytest.fixture
def paused_server(server_models):
    """A server whose engine does not step (so requests stay queued), with small bounds."""
    from decodekit.server.app import ServerThread
    from decodekit.server.backend import Backend, ServerConfig

    backend = Backend(server_models, ServerConfig(max_queued=2, request_timeout=1.0, kv_bytes=2**20,
                                                  retry_after=3))
    with ServerThread(backend) as thread:
        backend.engines["tiny"].stop()
        yield thread, backend
        backend.engines["tiny"].start()


def wait_for(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_full_queue_is_503_with_retry_after_then_timeouts_are_504(paused_server):
    thread, backend = paused_server
    engine = backend.engine("tiny")
    answers = []
    senders = [threading.Thread(target=lambda: answers.append(httpx.post(thread.url + COMPLETIONS, json=OK,
                                                                         timeout=30)))
               for _ in range(2)]
    for sender in senders:
        sender.start()
    wait_for(lambda: engine.stats()["waiting_requests"] == 2)
    full = httpx.post(thread.url + COMPLETIONS, json=OK)
    assert full.status_code == 503 and full.headers["Retry-After"] == "3"
    assert full.json()["error"]["code"] == "queue_full"
    for sender in senders:
        sender.join()
    # The engine never stepped, so both queued requests ran out of time and were cancelled.
    assert [a.status_code for a in answers] == [504, 504]
    assert answers[0].json()["error"]["type"] == "timeout_error"
    assert backend.counters["timed_out"] == 2 and backend.counters["rejected"] == 1
    engine.step()  # drops the cancelled requests
    assert engine.stats()["waiting_requests"] == 0 and engine.stats()["used_blocks"] == 0


def test_a_stream_that_times_out_ends_with_an_error_event(paused_server):
    thread, backend = paused_server
    client = openai.OpenAI(base_url=thread.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError, match="timeout"):
        for _ in client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=4, stream=True):
            pass
    backend.engines["tiny"].start()  # the server recovers
    assert client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=3).choices[0].text


def test_an_unhandled_error_is_a_500_counted_in_metrics(server, monkeypatch):
    """A route that raises is answered 500 by Starlette's outermost handler, outside the
    metrics middleware: it is counted all the same (issue 37: /metrics had no 500 series)."""
    from fastapi.testclient import TestClient

    from decodekit.server.app import create_app

    _, backend = server
    stats, calls = backend.stats, []

    def broken_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return stats()

    monkeypatch.setattr(backend, "stats", broken_once)
    client = TestClient(create_app(backend), base_url="http://127.0.0.1", raise_server_exceptions=False)
    answer = client.get("/health")
    assert answer.status_code == 500 and "a bug" in answer.json()["error"]["message"]
    scraped = client.get("/metrics").text
    assert 'decodekit_http_responses_total{status="500"} 1.0' in scraped


def test_integer_fields_take_integral_floats_as_openai_does(server):
    """`"type": "integer"` in the published schema allows 40.0 (JSON Schema), and OpenAI
    accepts it: so does the parser (issue 37: 400 invalid_type); 40.5 is still a 400 naming
    the field, and so is a string."""
    thread, _ = server
    integers = {"top_k": 40, "max_tokens": 2, "n": 1, "seed": 3, "allowed_token_ids": [5, 6],
                "prompt": [7, 8]}
    floats = body(top_k=40.0, max_tokens=2.0, n=1.0, seed=3.0, allowed_token_ids=[5.0, 6.0],
                  prompt=[7.0, 8.0])
    answer = httpx.post(thread.url + COMPLETIONS, json=floats)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] <= 2
    assert httpx.post(thread.url + COMPLETIONS, json=body(**integers)).json()["choices"] \
        == answer.json()["choices"]
    for field, value in [("top_k", 40.5), ("max_tokens", 2.5), ("allowed_token_ids", [5.5]), ("n", "1")]:
        refused = httpx.post(thread.url + COMPLETIONS, json=body(**{field: value}))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text


# A body that breaks each cross-field rule, and the field its 400 names.
BROKEN_RULES = {
    "best_of": (body(n=2, best_of=1), "best_of"),
    "vote": (body(vote="majority"), "best_of"),
    "scorer": (body(scorer="logprob"), "best_of"),
    "num_beams": (body(num_beams=2), "num_beams"),
    "draft_model": (body(use_beam_search=True, draft_model="tiny"), "draft_model"),
    "num_draft_tokens": (body(num_draft_tokens=2), "num_draft_tokens"),
    "top_logprobs": (chat_body(top_logprobs=2), "top_logprobs"),
}


def test_the_schema_says_every_cross_field_rule_the_server_checks(server):
    """Each rule of request_plan.py `CROSS_FIELD_RULES` is in its field's description in /openapi.json,
    and a body that breaks it is a 400 naming the field."""
    from decodekit.server.request_plan import CROSS_FIELD_RULES

    thread, _ = server
    schemas = httpx.get(thread.url + "/openapi.json").json()["components"]["schemas"]
    assert set(BROKEN_RULES) == set(CROSS_FIELD_RULES)
    for name, rule in CROSS_FIELD_RULES.items():
        request = "ChatRequest" if name == "top_logprobs" else "CompletionRequest"
        assert rule in schemas[request]["properties"][name]["description"]
        payload, param = BROKEN_RULES[name]
        path = CHAT if "messages" in payload else COMPLETIONS
        refused = httpx.post(thread.url + path, json=payload)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (name, refused.text)
