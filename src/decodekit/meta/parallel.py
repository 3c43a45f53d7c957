"""Parallel meta-generators (seed 001, "Meta-generators | parallel"): generate N candidates
{y1..yN} ~ G(.|x), then aggregate y = h(y1..yN).

- best-of-N:        argmax_i v(y_i) with any scorer v (Stiennon et al. 2020; Cobbe et al. 2021)
- rejection sampling: sample in rounds, stop at the first y with v(y) >= threshold (at most N)
- majority vote:    argmax_a sum_i 1[answer(y_i) = a] (self-consistency, Wang et al. 2023)
- weighted vote:    argmax_a sum_i v(y_i) 1[answer(y_i) = a] (seed 001; Wu et al. 2024b, Thm 2)

Tie rules (deterministic, so results are reproducible): best-of-N keeps the lowest index
among equal scores; a vote keeps the tied answer that occurs first in sample order, and its
chosen candidate is the first (majority) or the highest-scoring, first among equals
(weighted) candidate with that answer. Candidates without an answer (the extractor returned
None) or whose scorer failed do not vote and cannot be chosen.

The aggregators (`choose_best`, `vote`) are pure functions of candidate lists, so a caller
can generate once at the largest N and aggregate any subset (meta/evaluate.py).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from decodekit.completion import Completion
from decodekit.meta.budget import Budget
from decodekit.meta.generator import Generator, call_generator, derive_seed
from decodekit.meta.result import Candidate, MetaResult
from decodekit.meta.scorers import (
    check_on_error,
    outcome_scorer,
    score_candidates,
    score_kind_of,
    vote_weight,
)
from decodekit.params import SamplingParams
from decodekit.validate import check_n

Extractor = Callable[[str], Hashable | None]


def sample(
    generator: Generator,
    prompt: str,
    n: int,
    params: SamplingParams,
    budget: Budget,
    round_size: int | None = None,
) -> tuple[list[Completion], bool]:
    """Up to n completions of one prompt, `round_size` per generator call (default: all n in
    one call). Stops early when `budget` is exhausted; returns (completions, stopped early).
    Round 0 uses params.seed itself, so one round draws what `generate(n=n)` would."""
    check_n(n)
    round_size = n if round_size is None else round_size
    check_n(round_size, "round_size")
    completions: list[Completion] = []
    while len(completions) < n:
        if budget.exhausted:
            return completions, True
        k = min(round_size, n - len(completions))
        r = len(completions) // round_size
        seed = params.seed if r == 0 else derive_seed(params.seed, "round", r)
        [batch] = call_generator(generator, [prompt], k, params.replace(seed=seed), budget)
        completions += batch
    return completions, False


def candidates_of(completions: Sequence[Completion], extract: Extractor | None = None) -> list[Candidate]:
    return [
        Candidate(c.text, c, answer=extract(c.text) if extract is not None else None) for c in completions
    ]


def choose_best(candidates: Sequence[Candidate]) -> Candidate | None:
    """The highest-scoring candidate (lowest index among ties); failed/unscored ones skipped."""
    best = None
    for candidate in candidates:
        if candidate.score is not None and (best is None or candidate.score > best.score):
            best = candidate
    return best


def vote(candidates: Sequence[Candidate], weighted: bool = False,
         score_kind: str | None = None) -> tuple[Hashable | None, dict]:
    """(winning answer, {answer: total}) over candidates with an answer. Weighted: each votes
    its score (a logit's sigmoid, `score_kind` "logit": meta/scorers.py `vote_weight`; failed
    or unscored candidates do not vote); else each votes 1."""
    totals: dict = {}  # insertion order = first occurrence, which breaks ties
    for candidate in candidates:
        if candidate.answer is None or (weighted and candidate.score is None):
            continue
        weight = vote_weight(candidate.score, score_kind) if weighted else 1.0
        totals[candidate.answer] = totals.get(candidate.answer, 0.0) + weight
    winner = None
    for answer, total in totals.items():
        if winner is None or total > totals[winner]:
            winner = answer
    return winner, totals


def chosen_for(candidates: Sequence[Candidate], answer: Hashable | None, weighted: bool) -> Candidate | None:
    """The candidate that represents a winning answer (see the module's tie rules)."""
    holders = [c for c in candidates if answer is not None and c.answer == answer]
    if weighted:
        return choose_best(holders)
    return holders[0] if holders else None


def best_of_n(
    generator: Generator,
    prompt: str,
    n: int,
    scorer: Callable,
    params: SamplingParams | None = None,
    *,
    extract: Extractor | None = None,
    scorer_kind: str | None = None,
    on_error: str = "raise",
    budget: Budget | None = None,
    round_size: int | None = None,
) -> MetaResult:
    """Sample n, score each with `scorer`, return the highest (seed 001, "Best-of-N")."""
    check_on_error(on_error)
    score = outcome_scorer(scorer, scorer_kind)
    budget = budget if budget is not None else Budget()
    completions, stopped = sample(generator, prompt, n, params or SamplingParams(), budget, round_size)
    candidates = candidates_of(completions, extract)
    score_candidates(candidates, score, prompt, budget, on_error)
    chosen = choose_best(candidates)
    answer = chosen.answer if chosen is not None else None
    return MetaResult("best_of_n", chosen, candidates, budget.report(), answer, stopped_by_budget=stopped)


def rejection_sampling(
    generator: Generator,
    prompt: str,
    scorer: Callable,
    threshold: float,
    max_tries: int,
    params: SamplingParams | None = None,
    *,
    round_size: int = 4,
    extract: Extractor | None = None,
    scorer_kind: str | None = None,
    on_error: str = "raise",
    budget: Budget | None = None,
) -> MetaResult:
    """Sample `round_size` at a time and score them in order; stop at the first candidate
    whose score reaches `threshold` (seed 001: "Repeat ... stop if v(y) says the answer is
    correct"). At most `max_tries` samples. If none is accepted, the best seen is chosen and
    `tallies["accepted"]` is False. Candidates after the accepted one in its round are
    generated (and counted) but not scored."""
    check_n(max_tries, "max_tries")
    check_n(round_size, "round_size")
    check_on_error(on_error)
    score = outcome_scorer(scorer, scorer_kind)
    params = params or SamplingParams()
    budget = budget if budget is not None else Budget()
    candidates: list[Candidate] = []
    accepted, stopped, r = None, False, 0
    while accepted is None and len(candidates) < max_tries:
        if budget.exhausted:
            stopped = True
            break
        k = min(round_size, max_tries - len(candidates))
        seed = params.seed if r == 0 else derive_seed(params.seed, "round", r)
        [batch] = call_generator(generator, [prompt], k, params.replace(seed=seed), budget)
        start = len(candidates)
        candidates += candidates_of(batch, extract)
        accepted = score_candidates(candidates, score, prompt, budget, on_error, start, threshold)
        r += 1
    chosen = candidates[accepted] if accepted is not None else choose_best(candidates)
    answer = chosen.answer if chosen is not None else None
    tallies = {"accepted": accepted is not None, "tries": len(candidates)}
    return MetaResult("rejection_sampling", chosen, candidates, budget.report(), answer, tallies, stopped)


def majority_vote(
    generator: Generator,
    prompt: str,
    n: int,
    extract: Extractor,
    params: SamplingParams | None = None,
    *,
    budget: Budget | None = None,
    round_size: int | None = None,
) -> MetaResult:
    """Self-consistency: the most frequent extracted answer among n samples."""
    budget = budget if budget is not None else Budget()
    completions, stopped = sample(generator, prompt, n, params or SamplingParams(), budget, round_size)
    candidates = candidates_of(completions, extract)
    answer, totals = vote(candidates)
    chosen = chosen_for(candidates, answer, weighted=False)
    return MetaResult("majority_vote", chosen, candidates, budget.report(), answer, totals, stopped)


def weighted_vote(
    generator: Generator,
    prompt: str,
    n: int,
    extract: Extractor,
    scorer: Callable,
    params: SamplingParams | None = None,
    *,
    scorer_kind: str | None = None,
    on_error: str = "raise",
    budget: Budget | None = None,
    round_size: int | None = None,
) -> MetaResult:
    """argmax_a sum_i v(y_i) 1[answer(y_i) = a]: voting where each sample votes its reward
    (a logit reward model's sigmoid: `vote`)."""
    check_on_error(on_error)
    score = outcome_scorer(scorer, scorer_kind)
    budget = budget if budget is not None else Budget()
    completions, stopped = sample(generator, prompt, n, params or SamplingParams(), budget, round_size)
    candidates = candidates_of(completions, extract)
    score_candidates(candidates, score, prompt, budget, on_error)
    answer, totals = vote(candidates, weighted=True, score_kind=score_kind_of(scorer))
    chosen = chosen_for(candidates, answer, weighted=True)
    return MetaResult("weighted_vote", chosen, candidates, budget.report(), answer, totals, stopped)
