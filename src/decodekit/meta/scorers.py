"""Scorers as plain callables with a declared signature (ARCHITECTURE.md, "Scorers").

Outcome scorers (reward models, verifiers) take one of two signatures:
    completion -> float                      kind "text"
    (prompt, completion) -> float            kind "prompt"
Process scorers (process reward models) take one of:
    (question, steps) -> list[float]         kind "steps" (one score per step so far)
    prefix -> float                          kind "prefix" (the text up to a step's end)
    [(question, steps), ...] -> [list[float], ...]   kind "batch" (many paths in one call)
The kind is declared by the caller or, if not, read once from the number of required
positional parameters; `bool` results count as 0/1. A scorer that raises, returns NaN or
returns something that is not a number fails *for that candidate*: `score_candidates`
finishes the other candidates first, then either raises a `ScorerError` that names the
failed candidates and carries every candidate (on_error="raise") or records the failure on
the candidate and leaves it out of selection (on_error="record").

What a score means (`score_kind`, an attribute of the scorer where it declares one: reward
models do, meta/reward_models.py): "probability" (in [0, 1]) or "logit" (any real: a
sequence-classification ORM's raw output). Selection by the highest score needs no more;
a weighted vote and a product over steps need non-negative weights, so they take a logit's
sigmoid (`vote_weight`); a scorer that declares nothing is used as it is.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from numbers import Real

from decodekit.meta.budget import Budget
from decodekit.meta.result import Candidate

OUTCOME_KINDS = ("text", "prompt")  # in order of arity (1, 2)
SCORE_KINDS = ("probability", "logit")
PROCESS_KINDS = ("prefix", "steps", "batch")  # the first two in order of arity (1, 2)
ON_ERROR = ("raise", "record")

OutcomeScorer = Callable[[str, str], float]  # (prompt, completion) after `outcome_scorer`


class ScorerError(ValueError):
    """A scorer failed on some candidates; `candidates` holds every candidate's result."""

    def __init__(self, message: str, candidates: list[Candidate]):
        super().__init__(message)
        self.candidates = candidates


def score_kind_of(scorer) -> str | None:
    """The scorer's declared `score_kind` (SCORE_KINDS), or None when it declares none."""
    kind = getattr(scorer, "score_kind", None)
    if kind is not None and kind not in SCORE_KINDS:
        raise ValueError(f"score_kind must be one of {SCORE_KINDS}, got {kind!r}")
    return kind


def vote_weight(score: float, kind: str | None) -> float:
    """A score as a non-negative weight: a logit's sigmoid, anything else as it is."""
    if kind == "logit":
        return 1.0 / (1.0 + math.exp(-score)) if score >= 0 else math.exp(score) / (1.0 + math.exp(score))
    return score


def check_on_error(on_error: str) -> None:
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")


def required_positional(fn: Callable) -> int | None:
    """How many positional arguments `fn` requires, or None when Python cannot tell."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = signature.parameters.values()
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):
        return None
    return sum(1 for p in params if p.kind in kinds and p.default is inspect.Parameter.empty)


def _kind(fn: Callable, kind: str | None, kinds: tuple[str, str], what: str) -> str:
    if not callable(fn):
        raise TypeError(f"{what} must be callable, got {fn!r}")
    if kind is not None:
        if kind not in kinds:
            raise ValueError(f"{what} kind must be one of {kinds}, got {kind!r}")
        return kind
    arity = required_positional(fn)
    if arity in (1, 2):
        return kinds[arity - 1]
    raise TypeError(
        f"cannot tell the signature of {what} {fn!r} ({arity} required arguments); "
        f"declare kind= one of {kinds}"
    )


def outcome_scorer(fn: Callable, kind: str | None = None) -> OutcomeScorer:
    """`fn` as (prompt, completion) -> score. kind: "text" (fn(completion)) or "prompt"."""
    if _kind(fn, kind, OUTCOME_KINDS, "scorer") == "prompt":
        return fn
    return lambda prompt, completion: fn(completion)


def process_scorer(fn: Callable, kind: str | None = None) -> Callable[[list[tuple]], list]:
    """`fn` as a function of items (question, steps, prefix, previous scores) returning, per
    item, one score per step so far, or the exception that scoring that item raised.

    kind "steps": fn(question, steps) scores every step itself. kind "prefix": fn(prefix)
    sees the text up to the newest step and returns its score, appended to `previous` (the
    scores its parent's steps already have). kind "batch" (declared, never inferred):
    fn([(question, steps), ...]) -> [scores of item 0, ...] in one call; if that call
    raises, every item of the batch fails with its error."""
    kind = _kind(fn, kind, PROCESS_KINDS, "process scorer")

    def score(items: list[tuple]) -> list:
        if kind == "batch":
            try:
                values = list(fn([(question, list(steps)) for question, steps, _, _ in items]))
                if len(values) != len(items):
                    raise ValueError(f"returned {len(values)} results for {len(items)} items")
            except Exception as error:  # nothing says which item broke the batch
                return [error] * len(items)
            return values
        values = []
        for question, steps, prefix, previous in items:
            try:
                values.append(fn(question, list(steps)) if kind == "steps" else [*previous, fn(prefix)])
            except Exception as error:  # the failure belongs to this item
                values.append(error)
        return values

    return score


def as_number(value) -> float:
    """A scorer's value as a float; raises ValueError/TypeError for NaN or a non-number."""
    if isinstance(value, bool):
        return float(value)
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()  # a 0-d tensor or numpy scalar
    if not isinstance(value, Real):
        raise TypeError(f"returned {value!r} ({type(value).__name__}), not a number")
    value = float(value)
    if math.isnan(value):
        raise ValueError("returned nan")
    return value


def describe(index: int, text: str) -> str:
    short = text if len(text) <= 40 else text[:37] + "..."
    return f"candidate {index} ({short!r})"


def score_candidates(
    candidates: Sequence[Candidate],
    scorer: OutcomeScorer,
    prompt: str,
    budget: Budget,
    on_error: str = "raise",
    start: int = 0,
    stop_at: float | None = None,
) -> int | None:
    """Set `score` (or `error`) of candidates[start:], one scorer call each, or one call for
    all of them where the scorer has `score_many(prompt, texts) -> scores` (a reward model
    batching them: meta/tasks/arith.py `load_orm`; if that call raises, every candidate fails
    with its error), or `score_completions(prompt, completions) -> scores`, which it prefers
    where every candidate has its Completion (a probe reading the generation's log-probs:
    `load_orm(..., policy=model)`).

    With `stop_at`, stops after the first candidate whose score is >= stop_at and returns its
    index (rejection sampling); otherwise returns None. Failures are collected and, with
    on_error="raise", reported together after the other candidates are scored."""
    check_on_error(on_error)
    failed = []
    many = getattr(scorer, "score_many", None)
    rest = candidates[start:]
    if getattr(scorer, "score_completions", None) is not None and all(c.completion is not None for c in rest):
        many, rest = scorer.score_completions, [c.completion for c in rest]
    else:
        rest = [c.text for c in rest]
    values: list = [None] * len(candidates)
    if many is not None and stop_at is None and start < len(candidates):
        try:
            values[start:] = list(many(prompt, rest))
            if len(values) != len(candidates):
                raise ValueError(f"score_many returned {len(values) - start} scores for "
                                 f"{len(candidates) - start} texts")
        except Exception as error:  # nothing says which candidate broke the batch
            values = [error] * len(candidates)
    for i in range(start, len(candidates)):
        candidate = candidates[i]
        budget.add_scorer_calls()
        try:
            value = values[i] if many is not None and stop_at is None else scorer(prompt, candidate.text)
            if isinstance(value, Exception):
                raise value
            candidate.score = as_number(value)
        except Exception as error:  # a scorer's failure belongs to its candidate
            candidate.score, candidate.error = None, f"{type(error).__name__}: {error}"
            failed.append(i)
            continue
        if stop_at is not None and candidate.score >= stop_at:
            raise_failures(candidates, failed, on_error)
            return i
    raise_failures(candidates, failed, on_error)
    return None


def raise_failures(candidates: Sequence[Candidate], failed: list[int], on_error: str) -> None:
    if failed and on_error == "raise":
        names = "; ".join(f"{describe(i, candidates[i].text)}: {candidates[i].error}" for i in failed)
        raise ScorerError(
            f"scorer failed on {len(failed)} of {len(candidates)} candidates: {names} "
            "(pass on_error='record' to keep going without them)",
            list(candidates),
        )
