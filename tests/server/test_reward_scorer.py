"""`serve --reward-model` with a Hugging Face sequence-classification ORM (`arith-hf-orm`, a
logit): a `best_of` request whose `scorer` names it picks what the library picks, and a
weighted vote weighs the logits by their sigmoid."""

from __future__ import annotations

import httpx
import pytest

import decodekit as dk
from decodekit.meta.parallel import candidates_of, choose_best, vote
from decodekit.meta.rewards import load_reward_model
from decodekit.meta.tasks.arith import extract_answer, format_prompt, generate_problems
from decodekit.params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
ORM = "arith-hf-orm"


@pytest.fixture(scope="module")
def arith_server():
    from decodekit.server.app import ServerThread
    from decodekit.server.backend import Backend, ServerConfig

    model = dk.load_model("arith")
    backend = Backend({"arith": model}, ServerConfig(max_tokens=64, max_n=16, reward_models=(ORM,)))
    with ServerThread(backend) as thread:
        yield thread, model


def library_candidates(model, prompt: str, n: int, seed: int):
    [samples] = [dk.generate(model, prompt, SamplingParams(n=n, max_new_tokens=48, seed=seed))]
    orm = load_reward_model(ORM)
    candidates = candidates_of(samples, extract_answer)
    for candidate, [score] in zip(candidates, orm.score_batch([(prompt, [c.text]) for c in candidates])):
        candidate.score = score
    return candidates


def test_best_of_with_a_sequence_classification_orm_equals_the_library(arith_server):
    thread, model = arith_server
    prompt = format_prompt(generate_problems(1, seed=5)[0])
    candidates = library_candidates(model, prompt, 8, seed=3)
    assert any(c.score < 0 for c in candidates) or any(c.score > 1 for c in candidates)  # logits
    best = choose_best(candidates)
    body = {"model": "arith", "prompt": prompt, "max_tokens": 48, "seed": 3, "best_of": 8, "scorer": ORM}
    [choice] = httpx.post(thread.url + "/v1/completions", json=body, timeout=120).json()["choices"]
    assert choice["text"] == best.text
    assert choice["score"] == pytest.approx(best.score, abs=1e-5)


def test_weighted_vote_weighs_logits_by_their_sigmoid(arith_server):
    thread, model = arith_server
    prompt = format_prompt(generate_problems(2, seed=5)[1])
    candidates = library_candidates(model, prompt, 12, seed=4)
    answer, totals = vote(candidates, weighted=True, score_kind="logit")
    assert all(total > 0 for total in totals.values())  # sigmoids: every vote counts for its answer
    body = {"model": "arith", "prompt": prompt, "max_tokens": 48, "seed": 4, "best_of": 12, "scorer": ORM,
            "vote": "weighted", "answer_regex": r"Answer:\s*(-?\d+)"}
    [choice] = httpx.post(thread.url + "/v1/completions", json=body, timeout=120).json()["choices"]
    assert extract_answer(choice["text"]) == answer
