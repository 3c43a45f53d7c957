"""Minimum Bayes risk selection (REFERENCES.md, "Meta-generation").

    y* = argmax_{y in Y} (1/N) sum_i u(y, y_i)

over N samples Y that serve both as hypotheses and as pseudo-references (the sample
average estimates the expected utility under the model). Weighted voting is MBR with
u(y, y') = 1[answer(y) = answer(y')] * v(y'); majority voting is MBR with exact match of
the answers.

A utility is a `Utility(name, fn, symmetric)`; fn(hypothesis, reference) -> float. When it
is symmetric (exact match, edit similarity) each unordered pair is computed once and the
matrix mirrored: N (N + 1) / 2 calls instead of N^2. chrF and BLEU weigh hypothesis and
reference differently, so they are not symmetric. Ties go to the lowest index.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from decodekit.meta.budget import Budget
from decodekit.meta.generator import Generator
from decodekit.meta.parallel import candidates_of, sample
from decodekit.meta.result import MetaResult
from decodekit.meta.scorers import as_number, describe
from decodekit.params import SamplingParams


@dataclass(frozen=True)
class Utility:
    name: str
    fn: Callable[[str, str], float]
    symmetric: bool = False


def exact_match(hypothesis: str, reference: str) -> float:
    return float(hypothesis == reference)


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def edit_similarity(hypothesis: str, reference: str) -> float:
    """1 - levenshtein / max length (1 for two empty strings)."""
    longest = max(len(hypothesis), len(reference))
    return 1.0 if longest == 0 else 1.0 - levenshtein(hypothesis, reference) / longest


def chrf(hypothesis: str, reference: str) -> float:
    """Sentence chrF (Popovic 2015) through sacrebleu, in [0, 100]."""
    from sacrebleu.metrics import CHRF

    return CHRF().sentence_score(hypothesis, [reference]).score


def bleu(hypothesis: str, reference: str) -> float:
    """Sentence BLEU with exponential smoothing through sacrebleu, in [0, 100]."""
    from sacrebleu.metrics import BLEU

    return BLEU(effective_order=True).sentence_score(hypothesis, [reference]).score


UTILITIES = {
    "exact_match": Utility("exact_match", exact_match, symmetric=True),
    "edit_similarity": Utility("edit_similarity", edit_similarity, symmetric=True),
    "chrf": Utility("chrf", chrf),
    "bleu": Utility("bleu", bleu),
}


def as_utility(utility: str | Utility | Callable[[str, str], float]) -> Utility:
    """A utility by name, a `Utility`, or a plain callable (treated as not symmetric)."""
    if isinstance(utility, Utility):
        return utility
    if isinstance(utility, str):
        if utility not in UTILITIES:
            raise ValueError(f"unknown utility {utility!r}; choose from {sorted(UTILITIES)}")
        return UTILITIES[utility]
    if callable(utility):
        return Utility(getattr(utility, "__name__", "utility"), utility)
    raise TypeError(f"utility must be a name, a Utility or a callable, got {utility!r}")


def utility_matrix(items: Sequence[str], utility: Utility, budget: Budget | None = None) -> list[list[float]]:
    """U[i][j] = u(items[i], items[j]); a symmetric utility is called once per pair i <= j."""
    n = len(items)
    matrix = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i if utility.symmetric else 0, n):
            if budget is not None:
                budget.add_scorer_calls()
            try:
                value = as_number(utility.fn(items[i], items[j]))
            except Exception as error:
                raise ValueError(
                    f"utility {utility.name} failed on {describe(i, items[i])} vs "
                    f"{describe(j, items[j])}: {error}"
                ) from error
            matrix[i][j] = value
            if utility.symmetric:
                matrix[j][i] = value
    return matrix


def mbr_select(
    matrix: Sequence[Sequence[float]], weights: Sequence[float] | None = None
) -> tuple[int, list[float]]:
    """(argmax_i, expected utilities) with E_i = sum_j w_j U[i][j] / sum_j w_j (w = 1 default)."""
    n = len(matrix)
    if n == 0:
        raise ValueError("MBR needs at least one candidate")
    weights = [1.0] * n if weights is None else list(weights)
    if len(weights) != n or sum(weights) <= 0:
        raise ValueError(f"weights must be {n} numbers with a positive sum, got {weights!r}")
    total = sum(weights)
    expected = [sum(w * u for w, u in zip(weights, row)) / total for row in matrix]
    best = max(range(n), key=lambda i: (expected[i], -i))
    return best, expected


def mbr(
    generator: Generator,
    prompt: str,
    n: int,
    utility: str | Utility | Callable[[str, str], float] = "edit_similarity",
    params: SamplingParams | None = None,
    *,
    key: Callable[[str], str] | None = None,
    budget: Budget | None = None,
    round_size: int | None = None,
) -> MetaResult:
    """Sample n and return the one with the highest expected utility against the others.

    `key` maps a completion to the string the utility compares (e.g. its final answer);
    a completion whose key is None is compared as the empty string."""
    utility = as_utility(utility)
    budget = budget if budget is not None else Budget()
    completions, stopped = sample(generator, prompt, n, params or SamplingParams(), budget, round_size)
    candidates = candidates_of(completions, key)
    if not candidates:
        return MetaResult("mbr", None, [], budget.report(), stopped_by_budget=stopped)
    items = [c.text if key is None else str(c.answer if c.answer is not None else "") for c in candidates]
    best, expected = mbr_select(utility_matrix(items, utility, budget))
    for candidate, value in zip(candidates, expected):
        candidate.score = value
    chosen = candidates[best]
    tallies = {"expected_utility": expected, "utility": utility.name}
    return MetaResult("mbr", chosen, candidates, budget.report(), chosen.answer, tallies, stopped)
