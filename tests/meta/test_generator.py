"""LocalGenerator and Budget: exact counts on a greedy k-gram model, shared prefill."""

from __future__ import annotations

import pytest
from meta_toys import TOY_PROMPT

from decodekit.meta.budget import Budget
from decodekit.meta.generator import LocalGenerator, call_generator, derive_seed
from decodekit.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=8)


class CountingModel:
    """Wraps a LanguageModel and records the shape of every forward call."""

    def __init__(self, model):
        self.model = model
        self.calls = []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, tokens, cache, mask=None):
        self.calls.append(tuple(tokens.shape))
        return self.model.forward(tokens, cache, mask)


def test_n_samples_prefill_the_prompt_once(toy_model):
    model = CountingModel(toy_model)
    gen = LocalGenerator(model)
    [completions] = gen.generate([TOY_PROMPT], 5, GREEDY)
    # greedy: "a\nx" then EOS = 4 tokens each
    assert [c.text for c in completions] == ["a\nx"] * 5
    assert model.calls[0] == (1, 2)  # one prefill row of the 2-token prompt
    assert all(shape == (5, 1) for shape in model.calls[1:])  # then 5 rows, one token each
    assert gen.budget.counts() == {
        "generator_calls": 1, "prompt_tokens": 2, "generated_tokens": 20,
        "reused_prefix_tokens": 8, "scorer_calls": 0, "tool_calls": 0,
    }


@pytest.mark.parametrize("mode, calls, prefill_rows", [("replicated", 5, 5), ("separate", 5, 1)])
def test_without_prefix_sharing_every_sample_prefills(toy_model, mode, calls, prefill_rows):
    model = CountingModel(toy_model)
    gen = LocalGenerator(model, prefix=mode)
    [completions] = gen.generate([TOY_PROMPT], 5, GREEDY)
    assert [c.text for c in completions] == ["a\nx"] * 5  # greedy: the same outputs
    assert model.calls[0] == (prefill_rows, 2)
    counts = gen.budget.counts()
    assert counts["generator_calls"] == calls and counts["prompt_tokens"] == 10
    assert counts["reused_prefix_tokens"] == 0 and counts["generated_tokens"] == 20


def test_per_prompt_counts_and_params(toy_model):
    gen = LocalGenerator(toy_model)
    params = [GREEDY, GREEDY.replace(max_new_tokens=1)]
    results = gen.generate([TOY_PROMPT, "Q\nb\n"], [2, 3], params)
    assert [len(r) for r in results] == [2, 3]
    assert results[0][0].text == "a\nx" and results[1][0].text == "c"
    # prompts 2 and 4 tokens; 2 x 4 + 3 x 1 generated
    assert gen.budget.prompt_tokens == 6 and gen.budget.reused_prefix_tokens == 2 + 8
    assert gen.budget.generated_tokens == 11 and gen.budget.generator_calls == 2


def test_generator_rejects_bad_n(toy_model):
    gen = LocalGenerator(toy_model)
    for bad, error in ((0, ValueError), (-2, ValueError), (1.0, TypeError)):
        with pytest.raises(error, match="n must be an integer >= 1"):
            gen.generate([TOY_PROMPT], bad, GREEDY)
    with pytest.raises(ValueError, match="one count per prompt"):
        gen.generate([TOY_PROMPT], [1, 2], GREEDY)
    with pytest.raises(ValueError, match="prefix must be one of"):
        LocalGenerator(toy_model, prefix="radix")


def test_call_generator_copies_spend_once(toy_model):
    gen = LocalGenerator(toy_model)
    gen.generate([TOY_PROMPT], 1, GREEDY)  # spent before: not the strategy's
    budget = Budget()
    call_generator(gen, [TOY_PROMPT], 2, GREEDY, budget)
    assert budget.generated_tokens == 8 and gen.budget.generated_tokens == 12
    shared = LocalGenerator(toy_model, budget=budget)
    call_generator(shared, [TOY_PROMPT], 1, GREEDY, budget)  # the same object: counted once
    assert budget.generated_tokens == 12 and budget.generator_calls == 2


def test_budget_limits_and_report():
    budget = Budget(limits={"generated_tokens": 10, "scorer_calls": 3})
    budget.add_generation(5, 9, reused=5)
    assert not budget.exhausted
    snapshot = budget.counts()
    budget.add_scorer_calls(3)
    assert budget.exhausted
    assert budget.since(snapshot)["scorer_calls"] == 3 and budget.since(snapshot)["generated_tokens"] == 0
    report = budget.report()
    assert report["limits"] == {"generated_tokens": 10, "scorer_calls": 3} and report["exhausted"]
    with pytest.raises(ValueError, match="budget limit 'tokens' is not one of"):
        Budget(limits={"tokens": 5})
    with pytest.raises(ValueError, match="must be a positive number"):
        Budget(limits={"generated_tokens": 0})


def test_derive_seed_is_stable_and_distinct():
    assert derive_seed(None, 1) is None
    assert derive_seed(7, "round", 1) == derive_seed(7, "round", 1)
    seeds = {derive_seed(7, "round", r) for r in range(100)} | {derive_seed(8, "round", 1)}
    assert len(seeds) == 101
