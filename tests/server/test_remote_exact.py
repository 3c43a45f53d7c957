"""RemoteGenerator is exact or refuses: neutral values for every field a server knows, a
refusal for a field it drops (unknown to its profile, or shown by a probe to have no effect),
a scoring check on first use; the chat endpoint; a pool of endpoints."""

from __future__ import annotations

import json

import httpx
import pytest

from decodekit.meta.generator import LocalGenerator
from decodekit.meta.remote import RemoteError, RemoteGenerator
from decodekit.params import SamplingParams


@pytest.fixture(scope="module")
def shakespeare():
    from decodekit.models.registry import load_model

    return load_model("shakespeare")


@pytest.fixture(scope="module")
def servers(shakespeare):
    """Two decodekit servers over the embedded shakespeare model."""
    from decodekit.server.app import ServerThread
    from decodekit.server.backend import Backend, ServerConfig

    config = ServerConfig(max_tokens=64, kv_bytes=8 * 2**20)
    with ServerThread(Backend({"shakespeare": shakespeare}, config)) as one, \
            ServerThread(Backend({"shakespeare": shakespeare}, config)) as two:
        yield one.url, two.url


def test_decodekit_server_detected_probed_and_exact(servers, shakespeare):
    with RemoteGenerator(servers[0], "shakespeare") as remote:
        params = SamplingParams(max_new_tokens=6, temperature=0.7, top_k=5, repetition_penalty=1.3, seed=3)
        got = remote.generate(["ROMEO:"], 2, params)
        want = LocalGenerator(shakespeare).generate(["ROMEO:"], 2, params)
        endpoint = remote.endpoints[0]
        assert endpoint.profile.name == "decodekit"  # from /v1/models' owned_by
        assert endpoint.honoured == {"top_k": True, "repetition_penalty": True}  # each probed once
        assert [c.text for c in got[0]] == [c.text for c in want[0]]
        continuations = [" But soft", "\nJULIET"]
        assert remote.score("ROMEO:", continuations) == pytest.approx(
            LocalGenerator(shakespeare).score("ROMEO:", continuations), abs=1e-4)
        assert endpoint.scoring is None  # checked: echo agrees with generation


def test_chat_endpoint_as_a_generator(servers):
    with RemoteGenerator(servers[0], "shakespeare", chat=True) as remote:
        [[a, b]] = remote.generate(["Who art thou?"], 2, SamplingParams(max_new_tokens=5, seed=1))
        assert a.text and len(a.logprobs) == a.usage.completion_tokens and a.text != b.text
        with pytest.raises(ValueError, match="chat endpoint cannot score"):
            remote.score("a", ["b"])


def test_a_pool_gives_one_servers_answers_and_budget(servers):
    params = [SamplingParams(max_new_tokens=6, seed=s) for s in (1, 2)]
    with RemoteGenerator([servers[0]], "shakespeare") as one, \
            RemoteGenerator(list(servers), "shakespeare", max_concurrency=4) as pool:
        single = one.generate(["ROMEO:", "JULIET:"], 4, params)
        spread = pool.generate(["ROMEO:", "JULIET:"], 4, params)
        assert [[c.text for c in cs] for cs in spread] == [[c.text for c in cs] for cs in single]
        assert len({c.text for c in single[0]}) > 1  # the samples differ: each has its own seed
        assert pool.budget.generated_tokens == one.budget.generated_tokens
        assert pool.budget.prompt_tokens == one.budget.prompt_tokens
        assert all(e.outstanding == 0 for e in pool.endpoints)


def test_a_pool_moves_past_a_dead_endpoint(servers):
    dead = "http://127.0.0.1:9"  # discard port: connection refused
    with RemoteGenerator([dead, servers[0]], "shakespeare", backoff=0.0, profile="decodekit") as pool:
        out = pool.generate(["ROMEO:"] * 3, 1, SamplingParams(max_new_tokens=3, seed=0))
        assert all(cs[0].text for cs in out)
    with RemoteGenerator([dead], "shakespeare", retries=1, backoff=0.0, profile="decodekit") as alone, \
            pytest.raises(RemoteError, match="127.0.0.1:9"):
        alone.generate(["ROMEO:"], 1, SamplingParams(max_new_tokens=3))


# ---------------------------------------------------------------------------------- a fake llama.cpp


def fake_llamacpp(honours_top_k: bool = True):
    """llama-cpp-python's server as it behaves: owned_by "me", its own names and defaults,
    unknown fields dropped, n ignored, and echoed prompt log-probs shifted by one position.
    Text is one character per token; greedy writes "a"s; a seeded draw writes letter seed % 5
    unless top_k 1 (when honoured) or top_p/min_p leave one token; a repeat penalty > 1 or a
    presence penalty > 0 makes greedy write letters that neither the prompt nor the text
    holds yet."""
    bodies = []

    def logprob(i: int) -> float:  # of the character at position i
        return -0.1 * (i % 3 + 1)

    def respond(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "owned_by": "me"}]})
        body = json.loads(request.content)
        bodies.append(body)
        prompt, greedy = body["prompt"], body.get("temperature", 0.8) == 0
        top_k = body.get("top_k", 40) if honours_top_k else 40
        one = top_k == 1 or body.get("top_p", 0.95) < 1e-6 or body.get("min_p", 0.05) >= 1
        letter = "a" if greedy or one else "abcde"[body.get("seed", 0) % 5]
        text = letter * body.get("max_tokens", 16)
        penalised = body.get("repeat_penalty", 1.1) > 1 or body.get("presence_penalty", 0) > 0
        if greedy and penalised:  # no letter the prompt or the text already holds, while there is one
            fresh = [c for c in "abcdefghijklmnopqrstuvwxyz" if c not in prompt]
            text = "".join(fresh[i % len(fresh)] for i in range(len(text)))
        start = len(prompt)
        choice = {"index": 0, "text": text, "finish_reason": "length",
                  "logprobs": {"tokens": list(text), "text_offset": list(range(start, start + len(text))),
                               "token_logprobs": [logprob(start + i) for i in range(len(text))]}}
        if body.get("echo"):
            full = prompt + text
            choice = {"index": 0, "text": full, "finish_reason": "length", "logprobs": {
                "tokens": list(full), "text_offset": list(range(len(full))),
                "token_logprobs": [None] + [logprob(i + 1) for i in range(1, len(full))]}}  # shifted
        return httpx.Response(200, json={"choices": [choice], "usage": {
            "prompt_tokens": len(prompt), "completion_tokens": len(text)}})

    generator = RemoteGenerator("http://llama.test", "m", backoff=0.0, transport=httpx.MockTransport(respond))
    return generator, bodies


def test_neutral_values_under_llamacpp_names():
    generator, bodies = fake_llamacpp()
    [[completion]] = generator.generate(["x"], 1, SamplingParams(max_new_tokens=3, temperature=0.0))
    assert generator.endpoints[0].profile.name == "llamacpp"
    assert {k: bodies[0][k] for k in ("top_k", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                                      "frequency_penalty")} == \
        {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0, "presence_penalty": 0.0,
         "frequency_penalty": 0.0}
    assert completion.text == "aaa"
    generator.generate(["x"], 2, SamplingParams(max_new_tokens=2, seed=1))  # n ignored: filled in


def test_fields_the_server_drops_are_refused():
    generator, _ = fake_llamacpp()
    with pytest.raises(ValueError, match="has no field typical_p"):
        generator.generate(["x"], 1, SamplingParams(typical_p=0.5))
    with pytest.raises(ValueError, match="has no field ignore_eos"):
        generator.generate(["x"], 1, SamplingParams(ignore_eos=True))
    [[c]] = generator.generate(["x"], 1, SamplingParams(max_new_tokens=2, repetition_penalty=1.2, seed=0))
    assert generator.endpoints[0].honoured == {"repetition_penalty": True}
    ignoring, bodies = fake_llamacpp(honours_top_k=False)
    with pytest.raises(ValueError, match="ignores top_k"):
        ignoring.generate(["x"], 1, SamplingParams(top_k=3))
    probes = len(bodies)
    with pytest.raises(ValueError, match="ignores top_k"):  # remembered: no second probe
        ignoring.generate(["x"], 1, SamplingParams(top_k=3))
    assert len(bodies) == probes


def test_shifted_echo_logprobs_are_refused_naming_the_endpoint():
    generator, _ = fake_llamacpp()
    with pytest.raises(ValueError, match=r"llama\.test/v1 echoes log-probabilities that disagree"):
        generator.score("ROMEO:", [" hi"])
    unchecked, _ = fake_llamacpp()
    unchecked.verify = False
    assert unchecked.score("ab", ["c"]) == pytest.approx([-0.1])  # the shifted number, unchecked


def test_unknown_server_needs_a_profile():
    generator = RemoteGenerator("http://odd.test", "m", transport=httpx.MockTransport(
        lambda request: httpx.Response(404, json={})))
    with pytest.raises(ValueError, match="pass profile="):
        generator.generate(["x"], 1, SamplingParams())
    with pytest.raises(ValueError, match="profile must be one of"):
        RemoteGenerator("http://odd.test", "m", profile="tgi")
