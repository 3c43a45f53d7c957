"""Parallel meta-generators: aggregators on hand-made candidate sets, strategies on a
scripted generator, scorer failures and bad input."""

from __future__ import annotations

import math
import random

import pytest
from meta_toys import ScriptedGenerator

from decodekit.meta.budget import Budget
from decodekit.meta.parallel import (
    best_of_n,
    choose_best,
    chosen_for,
    majority_vote,
    rejection_sampling,
    vote,
    weighted_vote,
)
from decodekit.meta.result import Candidate
from decodekit.meta.scorers import ScorerError, outcome_scorer
from decodekit.params import SamplingParams


def cands(answers, scores=None):
    scores = scores or [None] * len(answers)
    return [Candidate(f"y{i}", answer=a, score=s) for i, (a, s) in enumerate(zip(answers, scores))]


def test_choose_best_keeps_lowest_index_among_ties_and_skips_unscored():
    candidates = cands([1, 2, 3, 4], [0.2, 0.9, 0.9, None])
    assert choose_best(candidates) is candidates[1]
    assert choose_best(cands([1, 2], [None, None])) is None


def test_majority_vote_counts_and_breaks_ties_by_first_occurrence():
    candidates = cands([3, 5, 5, 3, None, 7])
    answer, totals = vote(candidates)
    assert totals == {3: 2.0, 5: 2.0, 7: 1.0}  # None does not vote
    assert answer == 3  # 3 and 5 tie at 2; 3 occurs first
    assert chosen_for(candidates, answer, weighted=False) is candidates[0]
    assert vote(cands([5, 3, 3]))[0] == 3
    assert vote(cands([None, None])) == (None, {})


def test_weighted_vote_sums_scores_per_answer():
    candidates = cands([3, 5, 5, 7], [0.9, 0.4, 0.4, 0.1])
    answer, totals = vote(candidates, weighted=True)
    assert answer == 3  # 0.9 > 0.4 + 0.4
    assert totals[5] == pytest.approx(0.8)
    candidates = cands([3, 5, 5], [0.5, 0.3, 0.4])
    answer, _ = vote(candidates, weighted=True)
    assert answer == 5  # 0.7 > 0.5 although 3 scores highest alone
    assert chosen_for(candidates, answer, weighted=True) is candidates[2]  # best holder of 5
    assert vote(cands([3, 5], [0.5, 0.5]), weighted=True)[0] == 3  # tie: first occurrence


def test_weighted_vote_with_constant_scores_equals_majority_vote():
    rng = random.Random(0)
    for _ in range(200):
        answers = [rng.choice([1, 2, 3, None]) for _ in range(rng.randint(1, 9))]
        c = rng.choice([0.3, 1.0, 2.5])
        plain = cands(answers)
        weighted = cands(answers, [c] * len(answers))
        assert vote(weighted, weighted=True)[0] == vote(plain)[0]
        w_answer = vote(weighted, weighted=True)[0]
        w_chosen = chosen_for(weighted, w_answer, weighted=True)
        m_chosen = chosen_for(plain, vote(plain)[0], weighted=False)
        assert (w_chosen and w_chosen.text) == (m_chosen and m_chosen.text)


def test_best_of_n_picks_highest_score_and_counts_budget():
    gen = ScriptedGenerator(["bb", "a", "cccc", "dd"])
    result = best_of_n(gen, "P:", 4, len)  # str -> float scorer
    assert result.text == "cccc"
    assert [c.score for c in result.candidates] == [2, 1, 4, 2]
    # one request of 4 samples: prompt "P:" prefilled once; tokens are chars + 1 stop token
    assert result.budget["generator_calls"] == 1
    assert result.budget["prompt_tokens"] == 2
    assert result.budget["reused_prefix_tokens"] == 6
    assert result.budget["generated_tokens"] == 3 + 2 + 5 + 3
    assert result.budget["scorer_calls"] == 4


def test_best_of_n_with_prompt_scorer_and_extractor():
    gen = ScriptedGenerator(["x=1", "x=22", "x=3"])
    seen = []

    def scorer(prompt, completion):
        seen.append(prompt)
        return -abs(int(completion[2:]) - 3)

    result = best_of_n(gen, "Q", 3, scorer, extract=lambda t: int(t[2:]))
    assert result.answer == 3 and seen == ["Q"] * 3


def test_majority_and_weighted_vote_strategies():
    gen = ScriptedGenerator(["A: 1", "A: 2", "A: 2", "junk", "A: 1", "A: 1"])

    def extract(text):
        return int(text[3:]) if text.startswith("A: ") else None

    result = majority_vote(gen, "Q", 6, extract)
    assert result.answer == 1 and result.tallies == {1: 3.0, 2: 2.0}
    assert result.chosen is result.candidates[0]
    scores = {"A: 1": 0.1, "A: 2": 0.9, "junk": 5.0}
    result = weighted_vote(ScriptedGenerator(gen.respond), "Q", 6, extract, lambda t: scores[t])
    assert result.answer == 2  # 0.9 + 0.9 > 3 * 0.1; "junk" has no answer, so no vote
    assert result.budget["scorer_calls"] == 6


def test_rejection_sampling_stops_at_first_accepted_in_rounds():
    gen = ScriptedGenerator(["a", "bb", "ccc", "dddd", "eeeee", "ffffff"])
    result = rejection_sampling(gen, "P", len, threshold=3, max_tries=6, round_size=2)
    assert result.text == "ccc" and result.tallies == {"accepted": True, "tries": 4}
    assert [c.score for c in result.candidates] == [1, 2, 3, None]  # "dddd" generated, unscored
    assert result.budget["generator_calls"] == 2 and result.budget["scorer_calls"] == 3
    assert [k for _, k in gen.requests] == [2, 2]


def test_rejection_sampling_without_acceptance_returns_best_seen():
    gen = ScriptedGenerator(["a", "bbb", "cc"])
    result = rejection_sampling(gen, "P", len, threshold=10, max_tries=5, round_size=2)
    assert result.tallies == {"accepted": False, "tries": 5}
    assert [k for _, k in gen.requests] == [2, 2, 1]  # the last round is cut to max_tries
    assert result.text == "bbb"


def test_rejection_sampling_falls_back_to_the_best_not_the_last_or_first():
    gen = ScriptedGenerator(["bb", "cccc", "a"])  # scores 2, 4, 1; threshold 5 never reached
    result = rejection_sampling(gen, "P", len, threshold=5, max_tries=3, round_size=2)
    assert result.tallies == {"accepted": False, "tries": 3} and result.text == "cccc"


def test_budget_limit_stops_between_rounds():
    gen = ScriptedGenerator(["abc"])  # 4 tokens per sample
    budget = Budget(limits={"generated_tokens": 5})
    result = best_of_n(gen, "P", 8, len, budget=budget, round_size=1)
    assert result.stopped_by_budget and len(result.candidates) == 2  # 4 < 5, then 8 >= 5
    assert result.budget["generated_tokens"] == 8 and result.budget["exhausted"]


def flaky(text):
    if text == "boom":
        raise RuntimeError("reward model crashed")
    if text == "nan":
        return math.nan
    if text == "str":
        return "high"
    return len(text)


def test_scorer_failures_raise_naming_candidates_and_keep_the_others():
    gen = ScriptedGenerator(["ok1", "boom", "nan", "okay2", "str"])
    with pytest.raises(ScorerError) as info:
        best_of_n(gen, "P", 5, flaky)
    message = str(info.value)
    assert "candidate 1 ('boom')" in message and "reward model crashed" in message
    assert "candidate 2 ('nan')" in message and "returned nan" in message
    assert "candidate 4 ('str')" in message and "not a number" in message
    assert "candidate 0" not in message and "candidate 3" not in message
    assert [c.score for c in info.value.candidates] == [3, None, None, 5, None]


def test_scorer_failures_recorded_when_asked():
    gen = ScriptedGenerator(["ok1", "boom", "nan", "okay2"])
    result = best_of_n(gen, "P", 4, flaky, on_error="record")
    assert result.text == "okay2"
    assert [c.failed for c in result.candidates] == [False, True, True, False]
    assert "RuntimeError" in result.candidates[1].error
    result = weighted_vote(ScriptedGenerator(["ok1", "boom", "boom"]), "P", 3, lambda t: t[:2], flaky,
                           on_error="record")
    assert result.answer == "ok" and result.tallies == {"ok": 3.0}  # failed candidates do not vote


@pytest.mark.parametrize(
    ("n", "error"), [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)]
)
def test_n_must_be_a_positive_integer(n, error):
    with pytest.raises(error, match="n must be an integer >= 1"):
        best_of_n(ScriptedGenerator(["a"]), "P", n, len)
    with pytest.raises(error, match="n must be an integer >= 1"):
        majority_vote(ScriptedGenerator(["a"]), "P", n, len)


def test_bad_options_raise():
    with pytest.raises(ValueError, match="on_error must be one of"):
        best_of_n(ScriptedGenerator(["a"]), "P", 2, len, on_error="ignore")
    with pytest.raises(ValueError, match="max_tries"):
        rejection_sampling(ScriptedGenerator(["a"]), "P", len, 1.0, max_tries=0)
    with pytest.raises(TypeError, match="declare kind"):
        outcome_scorer(lambda *args: 1.0)
    with pytest.raises(TypeError, match="must be callable"):
        outcome_scorer(3.0)
    with pytest.raises(ValueError, match="kind must be one of"):
        outcome_scorer(len, "steps")


def test_sampling_params_pass_through():
    seen = []

    class Spy(ScriptedGenerator):
        def generate(self, prompts, n, params):
            seen.append(params)
            return super().generate(prompts, n, params)

    best_of_n(Spy(["a"]), "P", 4, len, SamplingParams(temperature=0.7, seed=5), round_size=2)
    assert [p.temperature for p in seen] == [0.7, 0.7]
    assert seen[0].seed == 5 and seen[1].seed not in (5, None)  # each round its own seed


def test_a_logit_scorer_votes_its_sigmoid():
    """Raw logits would elect "b" (5 > 2 + 2); their sigmoids elect "a" (0.88 * 2 > 0.99)."""
    from decodekit.meta.scorers import vote_weight

    candidates = [Candidate("x", answer="a", score=2.0), Candidate("y", answer="a", score=2.0),
                  Candidate("z", answer="b", score=5.0)]
    assert vote(candidates, weighted=True)[0] == "b"
    answer, totals = vote(candidates, weighted=True, score_kind="logit")
    assert answer == "a" and totals["a"] == pytest.approx(2 / (1 + math.exp(-2)))
    assert vote_weight(-800.0, "logit") == pytest.approx(0.0) and vote_weight(0.3, "probability") == 0.3


def test_score_many_scores_every_candidate_in_one_call():
    from decodekit.meta.budget import Budget
    from decodekit.meta.scorers import score_candidates

    calls = []

    def scorer(prompt, text):
        raise AssertionError("score_many should be used")

    def score_many(prompt, texts):
        calls.append(list(texts))
        return [float(len(t)) for t in texts]

    scorer.score_many = score_many
    candidates = [Candidate(t) for t in ("a", "bbb", "cc")]
    score_candidates(candidates, scorer, "p", Budget())
    assert calls == [["a", "bbb", "cc"]] and [c.score for c in candidates] == [1.0, 3.0, 2.0]

    def broken(prompt, texts):
        raise RuntimeError("down")

    scorer.score_many = broken
    candidates = [Candidate(t) for t in ("a", "b")]
    score_candidates(candidates, scorer, "p", Budget(), on_error="record")
    assert all(c.score is None and "down" in c.error for c in candidates)
