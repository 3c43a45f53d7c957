"""RemoteGenerator: meta-generation through the server equals the same run on a LocalGenerator
(same seeds, same budget counts); retries, backoff, the n > 1 fallback and scoring errors
against a scripted endpoint."""

from __future__ import annotations

import json

import httpx
import pytest

from decodekit.meta.generator import LocalGenerator
from decodekit.meta.parallel import best_of_n, majority_vote
from decodekit.meta.remote import RemoteError, RemoteGenerator, RemoteRequestError, retry_wait
from decodekit.meta.tree import TreeConfig, tree_search
from decodekit.params import SamplingParams

COUNTS = ("generator_calls", "generated_tokens", "scorer_calls")


@pytest.fixture
def remote(server):
    thread, _ = server
    with RemoteGenerator(thread.url, "tiny", max_concurrency=4, return_token_ids=True) as generator:
        yield generator


@pytest.fixture
def local_gen(server_models):
    return LocalGenerator(server_models["tiny"])


def counts(budget) -> dict:
    """The counts both generators must agree on. Prompt tokens only in total, computed plus
    reused: the local generator also counts the hits of the model's persistent prefix cache
    (engine/engine.py `engine_for`), which the server (whose engine it shares here) does not report."""
    get = budget.__getitem__ if isinstance(budget, dict) else lambda name: getattr(budget, name)
    return {**{name: get(name) for name in COUNTS},
            "all_prompt_tokens": get("prompt_tokens") + get("reused_prefix_tokens")}


def test_generate_equals_local_generation(remote, local_gen):
    prompts = ["ROMEO:", "JULIET: O", "ROMEO:"]
    params = [SamplingParams(max_new_tokens=12, seed=s, temperature=0.8, top_k=40, stop=("e",))
              for s in (1, 2, 3)]
    got = remote.generate(prompts, [3, 1, 2], params)
    want = local_gen.generate(prompts, [3, 1, 2], params)
    assert [[c.text for c in cs] for cs in got] == [[c.text for c in cs] for cs in want]
    for cs, ws in zip(got, want):
        for c, w in zip(cs, ws):
            assert c.token_ids == w.token_ids and c.finish_reason == w.finish_reason
            assert c.stop_reason == w.stop_reason and c.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    assert counts(remote.budget) == counts(local_gen.budget)
    assert remote.budget.reused_prefix_tokens > 0  # samples of one request shared its prefill


def test_meta_generators_run_unchanged_on_the_endpoint(remote, local_gen):
    params = SamplingParams(max_new_tokens=8, seed=5)
    remote_bon = best_of_n(remote, "ROMEO:", 6, lambda text: text.count("o") - len(text) / 100, params)
    local_bon = best_of_n(local_gen, "ROMEO:", 6, lambda text: text.count("o") - len(text) / 100, params)
    assert [c.text for c in remote_bon.candidates] == [c.text for c in local_bon.candidates]
    assert remote_bon.text == local_bon.text
    assert counts(remote_bon.budget) == counts(local_bon.budget)

    first = lambda text: text[:1] or None  # noqa: E731
    assert majority_vote(remote, "JULIET:", 7, first, params).answer == \
        majority_vote(local_gen, "JULIET:", 7, first, params).answer

    def prm(prefix: str) -> float:  # a deterministic stand-in for a process reward model
        return (sum(map(ord, prefix)) % 97) / 97

    config = TreeConfig(width=2, max_depth=3, delimiter="e")
    e = local_gen.model.encode("e")[0]
    step = SamplingParams(max_new_tokens=6, seed=9, logit_bias={e: 4.0})  # steps often end in "e"
    remote_tree = tree_search(remote, "ROMEO:", prm, 4, "beam", step, config, prm_kind="prefix")
    local_tree = tree_search(local_gen, "ROMEO:", prm, 4, "beam", step, config, prm_kind="prefix")
    assert [c.text for c in remote_tree.candidates] == [c.text for c in local_tree.candidates]
    assert remote_tree.text == local_tree.text
    assert counts(remote_tree.budget) == counts(local_tree.budget)
    assert remote_tree.budget["generator_calls"] > 1  # the search went deeper than one step


def test_score_equals_local_score(remote, local_gen):
    continuations = [" But soft", "JULIET", ""]
    remote.verify = False  # the random model's greedy tokens are not text (test_remote_exact.py checks)
    got = remote.score("ROMEO:", continuations)
    assert got == pytest.approx(local_gen.score("ROMEO:", continuations), abs=1e-4)
    assert got[2] == 0.0
    assert remote.budget.prompt_tokens > 0  # the echo requests were counted


# ---------------------------------------------------------------------------------- scripted


def scripted(handler):
    """A RemoteGenerator over an in-process endpoint that records the bodies it receives."""
    bodies = []

    def respond(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        return handler(body, len(bodies))

    generator = RemoteGenerator("http://endpoint.test", "m", retries=3, backoff=0.0, profile="decodekit",
                                verify=False, transport=httpx.MockTransport(respond))
    return generator, bodies


def answer(choices: int, text: str = "ok", prompt_tokens: int = 3) -> httpx.Response:
    return httpx.Response(200, json={
        "choices": [{"index": i, "text": f"{text}{i}", "finish_reason": "stop",
                     "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.5, -0.25]}}
                    for i in range(choices)],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 2 * choices},
    })


def error(status: int, param=None, headers=None) -> httpx.Response:
    body = {"error": {"message": "no", "type": "x", "param": param, "code": None}}
    return httpx.Response(status, json=body, headers=headers)


def test_retries_on_429_and_5xx_then_succeeds():
    generator, bodies = scripted(lambda body, calls: error(429, headers={"Retry-After": "0"}) if calls == 1
                                 else error(503) if calls == 2 else answer(1))
    [[completion]] = generator.generate(["x"], 1, SamplingParams(max_new_tokens=2))
    assert completion.text == "ok0" and len(bodies) == 3
    assert completion.logprobs == [-0.5, -0.25] and completion.usage.completion_tokens == 2
    assert generator.budget.generator_calls == 1 and generator.budget.prompt_tokens == 3


def test_gives_up_after_the_retries():
    generator, bodies = scripted(lambda body, calls: error(500))
    with pytest.raises(RemoteError, match="500"):
        generator.generate(["x"], 1, SamplingParams())
    assert len(bodies) == 4  # the first try and 3 retries


def test_client_errors_are_not_retried():
    generator, bodies = scripted(lambda body, calls: error(400, "temperature"))
    with pytest.raises(RemoteRequestError) as caught:
        generator.generate(["x"], 2, SamplingParams())
    assert caught.value.param == "temperature" and len(bodies) == 1


def test_retry_wait_honours_retry_after_else_backs_off():
    assert retry_wait(httpx.Response(429, headers={"Retry-After": "7"}), 0, 0.5) == 7.0
    assert retry_wait(httpx.Response(503), 3, 0.5) == 4.0  # 0.5 * 2^3
    assert retry_wait(None, 1, 0.5) == 1.0  # a connection error
    assert retry_wait(httpx.Response(429, headers={"Retry-After": "9999"}), 0, 0.5) == 60.0


def test_refused_n_falls_back_to_seeded_single_requests():
    generator, bodies = scripted(lambda body, calls: error(400, "n") if body["n"] > 1 else answer(1))
    [samples] = generator.generate(["x"], 3, SamplingParams(seed=10, top_k=5, min_new_tokens=1))
    assert [b["n"] for b in bodies] == [3, 1, 1, 1]
    assert [b.get("seed") for b in bodies[1:]] == [10, 11, 12]
    assert bodies[0]["top_k"] == 5 and bodies[0]["min_tokens"] == 1  # extensions by name
    assert len(samples) == 3 and generator.n_supported is False
    assert generator.budget.generator_calls == 3 and generator.budget.prompt_tokens == 9
    generator.generate(["y"], 2, SamplingParams())  # remembered: no n > 1 request any more
    assert [b["n"] for b in bodies[4:]] == [1, 1]


def test_fewer_choices_than_asked_are_completed_one_by_one():
    generator, bodies = scripted(lambda body, calls: answer(1))
    [samples] = generator.generate(["x"], 2, SamplingParams(seed=4))
    assert len(samples) == 2 and [b["n"] for b in bodies] == [2, 1] and bodies[1]["seed"] == 5


def test_scoring_needs_echo_logprobs():
    generator, _ = scripted(lambda body, calls: httpx.Response(200, json={
        "choices": [{"index": 0, "text": body["prompt"], "logprobs": None}], "usage": {}}))
    with pytest.raises(ValueError, match="endpoint does not support scoring"):
        generator.score("a", ["b"])
    refusing, _ = scripted(lambda body, calls: error(400, "echo"))
    with pytest.raises(ValueError, match="endpoint does not support scoring"):
        refusing.score("a", ["b"])


def test_bad_arguments():
    with pytest.raises(ValueError, match="base_url"):
        RemoteGenerator("localhost:8000", "m")
    with pytest.raises(ValueError, match="max_concurrency"):
        RemoteGenerator("http://x", "m", max_concurrency=0)
    with pytest.raises(ValueError, match="retries"):
        RemoteGenerator("http://x", "m", retries=-1)


def test_decodekit_eval_runs_unchanged_on_an_endpoint():
    """The arith evaluation (meta/evaluate.py) through a server equals the local run: a
    character k-gram served off the engine (the worker thread), oracle scorers."""
    from decodekit.meta.evaluate import EvalConfig, arith_scorers, evaluate_arith
    from decodekit.meta.tasks.arith import ArithConfig, format_prompt, format_solution, generate_problems
    from decodekit.models.ngram import NGramConfig, train_ngram
    from decodekit.server.app import ServerThread
    from decodekit.server.backend import Backend

    problems = generate_problems(100, seed=11, config=ArithConfig(2, 3, 9))
    texts = [format_prompt(p) + format_solution(p) for p in problems]
    vocabulary = sorted(set("".join(texts))) + ["$"]
    ngram = train_ngram(texts, NGramConfig(5, "kneser-ney"), level="char", vocabulary=vocabulary, eos="$")
    config = EvalConfig(strategies=("majority", "bon-oracle", "beam-oracle"), ns=(2,), seeds=1,
                        problems=2, width=2)
    scorers = arith_scorers(config)
    held_out = generate_problems(2, seed=12, config=ArithConfig(2, 3, 9))
    local_report = evaluate_arith(config, LocalGenerator(ngram), scorers, held_out)
    with ServerThread(Backend({"arith": ngram})) as thread, \
            RemoteGenerator(thread.url, "arith", max_concurrency=2) as generator:
        remote_report = evaluate_arith(config, generator, scorers, held_out)

    def timeless(report):
        return [{k: v for k, v in row.items() if "seconds" not in k and "wall" not in k}
                for row in report["rows"]]

    assert timeless(remote_report) == timeless(local_report)
    assert sum(row["generated_tokens"] for row in remote_report["rows"]) > 0
