"""RemoteGenerator against servers as they really behave (issue 38): probes inside each
server's ranges (vLLM answers 400 to temperature > 2), penalties probed where servers apply
them (generated tokens), a probe that cannot decide names verify=False, failover when an
endpoint is down while profiles are detected, a refused connection said as such, and a
pool of different engines refusing seeded sampling."""

from __future__ import annotations

import json

import httpx
import pytest

from decodekit.cli import main
from decodekit.meta.generator import LocalGenerator
from decodekit.meta.remote import RemoteError, RemoteGenerator
from decodekit.params import SamplingParams

DEAD = "http://127.0.0.1:9"  # the discard port: connection refused


@pytest.fixture(scope="module")
def shakespeare():
    from decodekit.models.registry import load_model

    return load_model("shakespeare")


@pytest.fixture(scope="module")
def live(shakespeare):
    """decodekit's own server over shakespeare."""
    from decodekit.server.app import ServerThread
    from decodekit.server.backend import Backend, ServerConfig

    with ServerThread(Backend({"shakespeare": shakespeare}, ServerConfig(max_tokens=64,
                                                                          kv_bytes=8 * 2**20))) as thread:
        yield thread.url


def test_presence_and_frequency_penalties_are_probed_on_generated_tokens(live, shakespeare):
    """Servers penalise the tokens they generate, not the prompt: the old probe looked at the
    first generated token and refused both penalties on decodekit's own server."""
    params = SamplingParams(max_new_tokens=40, temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5)
    with RemoteGenerator(live, "shakespeare") as remote:
        [[got]] = remote.generate(["ROMEO:"], 1, params)
        assert remote.endpoints[0].honoured == {"presence_penalty": True, "frequency_penalty": True}
    [[want]] = LocalGenerator(shakespeare).generate(["ROMEO:"], 1, params)
    [[plain]] = LocalGenerator(shakespeare).generate(["ROMEO:"], 1, params.replace(presence_penalty=0.0,
                                                                                  frequency_penalty=0.0))
    assert got.text == want.text != plain.text


def fake_vllm(same_token: bool = False):
    """vLLM's answers as they are: owned_by "vllm", 400 for temperature outside [0, 2], top_k
    applied. One character per token; a seeded draw writes letter seed % 5 unless top_k is 1
    (or `same_token`: a model so sure that every draw is the same)."""
    bodies = []

    def respond(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "owned_by": "vllm"}]})
        body = json.loads(request.content)
        bodies.append(body)
        if not 0 <= body["temperature"] <= 2:
            return httpx.Response(400, json={"error": {"message": "temperature must be in [0, 2], got "
                                                       f"{body['temperature']}", "param": "temperature"}})
        one = body["temperature"] == 0 or body.get("top_k") == 1 or same_token
        text = ("a" if one else "abcde"[body.get("seed", 0) % 5]) * body["max_tokens"]
        return httpx.Response(200, json={"choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                                         "usage": {"prompt_tokens": 1, "completion_tokens": len(text)}})

    return RemoteGenerator("http://vllm.test", "m", backoff=0.0, request_logprobs=False,
                           transport=httpx.MockTransport(respond)), bodies


def test_the_filter_probe_stays_inside_vllms_temperature_range():
    generator, bodies = fake_vllm()
    [[completion]] = generator.generate(["x"], 1, SamplingParams(max_new_tokens=2, top_k=5, seed=0))
    assert generator.endpoints[0].honoured == {"top_k": True}
    assert max(body["temperature"] for body in bodies) == 2.0


def test_a_probe_that_cannot_decide_says_so_and_names_verify_false():
    generator, _ = fake_vllm(same_token=True)
    with pytest.raises(ValueError, match=r"cannot check that .* applies top_k \(8 draws at temperature 2.0 "
                                         r"were all the same token\); pass verify=False"):
        generator.generate(["x"], 1, SamplingParams(top_k=5))
    generator.verify = False
    generator.generate(["x"], 1, SamplingParams(max_new_tokens=1, top_k=5))  # sent unchecked


def test_a_probe_the_server_refuses_names_verify_false():
    def respond(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={"data": [{"id": "m", "owned_by": "sglang"}]})
        return httpx.Response(400, json={"error": {"message": "seed is not supported", "param": "seed"}})

    generator = RemoteGenerator("http://sglang.test", "m", transport=httpx.MockTransport(respond))
    with pytest.raises(ValueError, match=r"applies min_p: it refused the probe .*seed is not supported.*"
                                         r"pass verify=False"):
        generator.generate(["x"], 1, SamplingParams(min_p=0.1))


def test_a_pool_detects_past_an_endpoint_that_is_down(live):
    """No profile= given: the dead endpoint's detection fails like a request would, and the
    pool moves on (it used to stop with "cannot tell which server ... is")."""
    params = SamplingParams(max_new_tokens=3, seed=0, top_k=5)
    with RemoteGenerator([DEAD, live], "shakespeare", backoff=0.0) as pool, \
            RemoteGenerator([live], "shakespeare") as one:
        got = pool.generate(["ROMEO:"] * 3, 2, params)
        want = one.generate(["ROMEO:"] * 3, 2, params)  # a one-endpoint pool: the same seeds
        assert [[c.text for c in cs] for cs in got] == [[c.text for c in cs] for cs in want]
        assert pool.endpoints[0].profile is None and pool.endpoints[1].profile.name == "decodekit"
        continuations = [" But soft", "\nJULIET"]
        want = one.score("ROMEO:", continuations)
        assert pool.score("ROMEO:", continuations) == pytest.approx(want, abs=1e-6)  # scoring fails over too


def test_a_refused_connection_says_so():
    with RemoteGenerator(DEAD, "m", retries=1, backoff=0.0) as alone, \
            pytest.raises(RemoteError, match=r"cannot connect to http://127\.0\.0\.1:9/v1/models: connection "
                                             r"refused \(is a server running there\?\)"):
        alone.generate(["x"], 1, SamplingParams(max_new_tokens=3))


def test_eval_arith_endpoint_refused_is_one_line(capsys):
    code = main(["eval", "arith", "--endpoint", DEAD, "--problems", "1", "--seeds", "1", "--budgets", "1",
                 "--strategies", "majority"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "connection refused (is a server running there?)" in err


def mixed_pool(**options) -> RemoteGenerator:
    """Two endpoints, one decodekit and one vLLM by /v1/models."""
    def respond(request: httpx.Request) -> httpx.Response:
        owner = "decodekit" if request.url.host == "a.test" else "vllm"
        if request.method == "GET":
            return httpx.Response(200, json={"data": [{"id": "m", "owned_by": owner}]})
        text = owner[0] * json.loads(request.content)["max_tokens"]
        return httpx.Response(200, json={"choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                                         "usage": {"prompt_tokens": 1, "completion_tokens": len(text)}})

    return RemoteGenerator(["http://a.test", "http://b.test"], "m", transport=httpx.MockTransport(respond),
                           **options)


def test_a_pool_of_different_engines_refuses_seeded_sampling():
    with pytest.raises(ValueError, match="mixes decodekit and vllm servers, which draw different samples "
                                         "for the same seed.*mixed_engines=True"):
        mixed_pool().generate(["x"], 4, SamplingParams(max_new_tokens=2, seed=1))
    unseeded = mixed_pool().generate(["x"], 4, SamplingParams(max_new_tokens=2))
    assert {c.text for c in unseeded[0]} <= {"dd", "vv"}  # the same distribution: allowed
    accepted = mixed_pool(mixed_engines=True).generate(["x"], 4, SamplingParams(max_new_tokens=2, seed=1))
    assert len(accepted[0]) == 4
