"""Probe reward models: segment features by hand, the logistic fit, the shipped arith ORM/PRM."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from decodekit.meta.rewards import (
    FEATURES,
    ProbeRewardModel,
    encode_segments,
    fit_logistic,
    segment_features,
)
from decodekit.meta.tasks.arith import (
    format_prompt,
    format_solution,
    generate_problems,
    load_orm,
    load_prm,
    solve,
    split_steps,
)
from decodekit.models.registry import ASSETS

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def arith_policy():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ASSETS / "arith"
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_encode_segments_spans(arith_policy):
    _, tokenizer = arith_policy
    ids, spans = encode_segments(tokenizer, "Compute: 1+2*3=\n", ["2*3=6\n", "1+6=7\n"])
    assert len(ids) == 16 + 6 + 6  # one token per character
    assert spans == [(16, 22), (22, 28)]
    with pytest.raises(ValueError, match="no tokens"):
        encode_segments(tokenizer, "Compute: 1+2=\n", [""])


def test_segment_features_by_hand_and_batched_like_single(arith_policy):
    model, tokenizer = arith_policy
    prompt, segments = "Compute: 12+3*4=\n", ["3*4=12\n", "12+12=24\n", "Answer: 24\n"]
    ids, spans = encode_segments(tokenizer, prompt, segments)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    # log p of token i given tokens < i, and the entropy of that prediction
    token_lp = [logp[i - 1, ids[i]].item() for i in range(len(ids))]
    entropy = [-(logp[i - 1].exp() * logp[i - 1]).sum().item() for i in range(len(ids))]
    expected = []
    for start, end in spans:
        step, prefix = range(start, end), range(spans[0][0], end)
        expected.append([min(token_lp[i] for i in step), np.mean([token_lp[i] for i in step]),
                         max(entropy[i] for i in step), min(token_lp[i] for i in prefix),
                         np.mean([token_lp[i] for i in prefix]), max(entropy[i] for i in prefix)])
    short = ("Compute: 1+1=\n", ["Answer: 2\n"])  # batched with a shorter, right-padded row
    single, batched = (segment_features(model, tokenizer, items)[0]
                       for items in ([(prompt, segments)], [(prompt, segments), short]))
    np.testing.assert_allclose(single, np.asarray(expected), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(batched, single, rtol=1e-4, atol=1e-5)


def test_fit_logistic_finds_the_informative_feature():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, len(FEATURES)))
    y = (x[:, 2] + 0.3 * rng.normal(size=2000) > 0).astype(float)  # only feature 2 matters
    probe = fit_logistic(x, y)
    weights = np.asarray(probe["weights"])
    assert weights[2] > 3.0 and np.all(np.abs(np.delete(weights, 2)) < 0.3)


def test_probe_probability_formula():
    probe = {"features": list(FEATURES), "mean": [1.0] * 6, "std": [2.0] * 6,
             "weights": [0.5, 0, 0, 0, 0, -1.0], "bias": 0.25}
    model = ProbeRewardModel(torch.nn.Identity(), None, probe)
    x = np.array([[5.0, 0, 0, 0, 0, 3.0]])
    z = 0.5 * (5 - 1) / 2 - 1.0 * (3 - 1) / 2 + 0.25  # = 0.25
    assert model.probabilities(x)[0] == pytest.approx(1 / (1 + math.exp(-z)))
    with pytest.raises(ValueError, match="features"):
        ProbeRewardModel(torch.nn.Identity(), None, {**probe, "features": ["x"]})


def corrupt(problem) -> str:
    """The reference solution with its last operation off by one (answer following it)."""
    steps = solve(problem)
    lines = [f"{a}{op}{b}={r}" for a, op, b, r in steps[:-1]]
    a, op, b, r = steps[-1]
    return "\n".join(lines + [f"{a}{op}{b}={r + 1}", f"Answer: {r + 1}"])


def test_shipped_reward_models_prefer_correct_solutions():
    orm, prm = load_orm(), load_prm()  # by registry name: arith-orm, arith-prm
    problems = generate_problems(24, seed=2024)
    wins_orm = wins_prm = 0
    for p in problems:
        right, wrong = format_solution(p), corrupt(p)
        wins_orm += orm(p.question, right) > orm(p.question, wrong)
        right_steps = prm(format_prompt(p), split_steps(right))
        wrong_steps = prm(p.question, split_steps(wrong))
        assert len(wrong_steps) == len(split_steps(wrong))
        assert all(0.0 < s < 1.0 for s in right_steps + wrong_steps)
        # identical steps get identical scores: a step's score sees only the steps before it
        n_same = len(split_steps(right)) - 2
        assert right_steps[:n_same] == pytest.approx(wrong_steps[:n_same])
        wins_prm += min(right_steps) > min(wrong_steps)
    # learned and imperfect: better than chance on most problems, not necessarily all
    assert wins_orm >= 0.7 * len(problems) and wins_prm >= 0.7 * len(problems)


# ------------------------------------------------- features from the generation's log-probs


@pytest.fixture(scope="module")
def arith_samples():
    """8 samples of each of 6 problems by the embedded `arith` model (a NativeLM on its
    engine), with the entropies the probes read."""
    import decodekit as dk
    from decodekit.meta.generator import LocalGenerator
    from decodekit.params import SamplingParams

    model = dk.load_model("arith")
    prompts = [format_prompt(p) for p in generate_problems(6, seed=5)]
    params = SamplingParams(max_new_tokens=64, seed=0, entropies=True)
    return model, prompts, LocalGenerator(model).generate(prompts, 8, params)


def count_forwards(module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("name, whole", [("arith-orm", True), ("arith-prm", False)])
def test_probe_reads_the_generations_logprobs_with_no_forward(arith_samples, name, whole):
    """The reused path's scores equal the policy's second forward within 1e-5, per sequence
    (the ORM: the solution + "\\n", whose "\\n" stands where the policy drew EOS) and per step
    (the PRM), and neither the probe's policy nor the generating model runs a forward."""
    from decodekit.meta.rewards import load_reward_model
    from decodekit.meta.tasks.arith import DELIMITER

    model, prompts, samples = arith_samples
    probe = load_reward_model(name)
    ended = [(prompt, c) for prompt, cs in zip(prompts, samples) for c in cs if c.finish_reason == "stop"]
    assert len(ended) >= 40  # those ended by EOS (a sample cut at the length has no "\n" there)
    items = [(prompt, [c.text.strip() + DELIMITER] if whole else [s + DELIMITER for s in split_steps(c.text)])
             for prompt, c in ended]  # fmt: skip
    completions = [c for _, c in ended]
    expected = probe.score_batch(items)
    policy_calls, model_calls = count_forwards(probe.policy), count_forwards(model.net)
    reused = probe.score_batch(items, completions=completions, model=model)
    assert policy_calls[0] == 0 and model_calls[0] == 0
    assert probe.reused == len(items)
    assert [len(s) for s in reused] == [len(s) for s in expected]
    flat = np.array([x for s in reused for x in s]), np.array([x for s in expected for x in s])
    assert np.abs(flat[0] - flat[1]).max() < 1e-5
    assert len(set(flat[0].round(6))) > 10  # the scores differ between candidates


def test_probe_falls_back_to_the_forward_where_it_cannot_reuse(arith_samples):
    """Another model's weights, a completion without entropies, or segments that are not the
    completion's tokens: the policy's forward scores those items, and the scores are the
    plain path's."""
    import decodekit as dk
    from decodekit.meta.rewards import load_reward_model
    from decodekit.meta.tasks.arith import DELIMITER

    model, prompts, samples = arith_samples
    probe = load_reward_model("arith-orm")
    cs = samples[0][:3]
    items = [(prompts[0], [c.text.strip() + DELIMITER]) for c in cs]
    other = dk.load_model("arith-small")
    assert probe.same_weights(model) and not probe.same_weights(other)
    plain = np.array(probe.score_batch(items))
    policy_calls = count_forwards(probe.policy)
    assert np.allclose(probe.score_batch(items, completions=cs, model=other), plain, atol=1e-6)
    assert probe.reused == 0 and policy_calls[0] == 1
    from dataclasses import replace

    changed = [(prompts[0], [cs[0].text.strip() + " 1" + DELIMITER]), items[1],
               (prompts[0], [cs[2].text.strip() + DELIMITER])]
    given = [cs[0], cs[1], replace(cs[2], entropies=None)]
    scores = probe.score_batch(changed, completions=given, model=model)
    assert probe.reused == 1 and policy_calls[0] == 2  # only items[1] reused
    assert np.allclose(scores, probe.score_batch(changed), atol=1e-5)
    # weights changed in place: checked again
    weight = model.net.embed_tokens.weight
    kept = weight[0, 0].item()
    with torch.no_grad():
        weight[0, 0] += 1.0
    try:
        assert not probe.same_weights(model)
    finally:
        with torch.no_grad():
            weight[0, 0] = kept
    assert probe.same_weights(model)


def test_best_of_n_with_a_policy_bound_orm_runs_no_second_forward():
    """best_of_n through `load_orm(..., policy=model)` scores the candidates as the plain ORM
    does and picks the same one, with no forward of the probe's policy."""
    import decodekit as dk
    from decodekit.meta.generator import LocalGenerator
    from decodekit.meta.parallel import best_of_n
    from decodekit.params import SamplingParams

    model = dk.load_model("arith")
    prompt = format_prompt(generate_problems(1, seed=7)[0])
    params = SamplingParams(max_new_tokens=64, seed=3, entropies=True)
    plain = best_of_n(LocalGenerator(model), prompt, 8, load_orm("arith-orm"), params)
    bound = load_orm("arith-orm", policy=model)
    policy_calls = count_forwards(bound.reward_model.policy)
    reused = best_of_n(LocalGenerator(model), prompt, 8, bound, params)
    assert policy_calls[0] == 0 and bound.reward_model.reused == 8
    assert np.allclose([c.score for c in plain.candidates], [c.score for c in reused.candidates], atol=1e-5)
    assert plain.chosen.text == reused.chosen.text
