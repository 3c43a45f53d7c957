"""Minimum Bayes risk: brute-force agreement, one call per symmetric pair, utilities."""

from __future__ import annotations

import random

import pytest
from meta_toys import ScriptedGenerator

from decodekit.meta.bayes_risk import (
    Utility,
    as_utility,
    bleu,
    chrf,
    edit_similarity,
    exact_match,
    levenshtein,
    mbr,
    mbr_select,
    utility_matrix,
)
from decodekit.meta.budget import Budget
from decodekit.meta.parallel import vote
from decodekit.meta.result import Candidate


def brute_force(items, fn):
    expected = [sum(fn(y, r) for r in items) / len(items) for y in items]
    best = max(expected)
    return expected.index(best), expected


@pytest.mark.parametrize("name", ["exact_match", "edit_similarity", "chrf", "bleu"])
def test_mbr_equals_brute_force_argmax(name):
    rng = random.Random(1)
    utility = as_utility(name)
    for _ in range(5):
        items = ["".join(rng.choice("ab ") for _ in range(rng.randint(1, 6))) for _ in range(7)]
        best, expected = mbr_select(utility_matrix(items, utility))
        want_best, want_expected = brute_force(items, utility.fn)
        assert best == want_best
        assert expected == pytest.approx(want_expected)


def test_symmetric_utility_is_called_once_per_pair():
    calls = []

    def counted(a, b):
        calls.append((a, b))
        return edit_similarity(a, b)

    items = ["abc", "abd", "xbc", "abcd"]
    budget = Budget()
    matrix = utility_matrix(items, Utility("edit", counted, symmetric=True), budget)
    assert len(calls) == 4 * 5 // 2 and budget.scorer_calls == 10  # pairs i <= j
    assert len({frozenset(((0, a), (1, b))) for a, b in calls}) == len(calls)
    assert all(matrix[i][j] == matrix[j][i] for i in range(4) for j in range(4))
    calls.clear()
    utility_matrix(items, Utility("edit", counted, symmetric=False))
    assert len(calls) == 16


def test_utilities_by_hand():
    assert levenshtein("kitten", "sitting") == 3
    assert edit_similarity("kitten", "sitting") == pytest.approx(1 - 3 / 7)
    assert edit_similarity("", "") == 1.0
    assert exact_match("a", "a") == 1.0 and exact_match("a", "b") == 0.0
    assert chrf("the cat sat", "the cat sat") == pytest.approx(100.0)
    assert bleu("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(100.0)
    # chrF weighs recall twice as much as precision (beta = 2): not symmetric
    short, long = "the cat", "the cat sat on the mat"
    assert chrf(short, long) != pytest.approx(chrf(long, short))


def test_exact_match_mbr_over_answers_is_majority_vote():
    gen = ScriptedGenerator(["A 1", "A 2", "A 2", "A 3", "A 2", "A 1"])
    result = mbr(gen, "Q", 6, "exact_match", key=lambda t: t.split()[1])
    candidates = [Candidate(t, answer=t.split()[1]) for t in ["A 1", "A 2", "A 2", "A 3", "A 2", "A 1"]]
    assert result.answer == vote(candidates)[0] == "2"
    assert result.chosen is result.candidates[1]  # first holder of the winning answer
    assert result.tallies["expected_utility"] == pytest.approx([2 / 6, 3 / 6, 3 / 6, 1 / 6, 3 / 6, 2 / 6])
    assert result.budget["scorer_calls"] == 21


def test_mbr_picks_the_centroid_text():
    gen = ScriptedGenerator(["the cat sat", "the cat sat down", "a dog ran", "the cat sat"])
    result = mbr(gen, "Q", 4, "edit_similarity")
    assert result.text == "the cat sat" and result.chosen is result.candidates[0]


def test_mbr_weights_and_bad_input():
    matrix = [[1.0, 0.0], [0.0, 1.0]]
    assert mbr_select(matrix)[0] == 0  # tie: lowest index
    assert mbr_select(matrix, [1.0, 3.0])[0] == 1
    with pytest.raises(ValueError, match="at least one candidate"):
        mbr_select([])
    with pytest.raises(ValueError, match="unknown utility 'rouge'"):
        as_utility("rouge")
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        mbr(ScriptedGenerator(["a"]), "Q", 0)
    with pytest.raises(ValueError, match=r"utility boom failed on candidate 0 \('a'\)"):
        utility_matrix(["a", "b"], Utility("boom", lambda a, b: 1 / 0))
