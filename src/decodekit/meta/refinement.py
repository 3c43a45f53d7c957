"""Refinement (seed 001, "Meta-generators | refinement / self-correction"): generate, get
feedback, regenerate with the feedback in the prompt, up to k rounds, stop on success.

Feedback comes from a function or a verifier. Seed 001 finds refinement works when the
feedback is extrinsic and can detect *and localise* errors (verifiers, interpreters), and is
mixed when a model judges itself (Huang et al. 2024). So a `Feedback` can carry `keep`: a
verified prefix of the previous output (e.g. the steps a step checker accepted); the next
round then continues from it instead of starting over. Without `keep`, the next prompt is
`template` filled with the prompt, the previous output and the feedback message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from decodekit.meta.budget import Budget
from decodekit.meta.generator import Generator, call_generator, derive_seed
from decodekit.meta.parallel import Extractor
from decodekit.meta.result import Candidate, MetaResult
from decodekit.meta.scorers import as_number, outcome_scorer
from decodekit.params import SamplingParams
from decodekit.validate import check_int

DEFAULT_TEMPLATE = "{prompt}{previous}\nFeedback: {feedback}\nRevised answer:\n"


@dataclass(frozen=True)
class Feedback:
    """ok: the output is acceptable. message: what is wrong. keep: a verified prefix of the
    output to continue from (None: regenerate the whole output)."""

    ok: bool
    message: str = ""
    keep: str | None = None


def as_feedback(value, attempt: int) -> Feedback:
    """A feedback function's value: a Feedback, a bool, or (ok, message)."""
    if isinstance(value, Feedback):
        return value
    if isinstance(value, bool):
        return Feedback(value)
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], bool):
        return Feedback(value[0], str(value[1]))
    raise TypeError(
        f"feedback on attempt {attempt} returned {value!r}; expected a Feedback, a bool or (bool, str)"
    )


def verifier_feedback(scorer: Callable, threshold: float, kind: str | None = None) -> Callable:
    """Feedback from a verifier or reward model: ok when its score reaches `threshold`."""
    score = outcome_scorer(scorer, kind)

    def feedback(prompt: str, output: str) -> Feedback:
        value = as_number(score(prompt, output))
        return Feedback(value >= threshold, f"the verifier scored this {value:.3g}, below {threshold:.3g}")

    return feedback


def refine(
    generator: Generator,
    prompt: str,
    feedback: Callable[[str, str], Feedback | bool | tuple[bool, str]],
    rounds: int = 3,
    params: SamplingParams | None = None,
    *,
    template: str = DEFAULT_TEMPLATE,
    extract: Extractor | None = None,
    budget: Budget | None = None,
) -> MetaResult:
    """One generation, then up to `rounds` regenerations while feedback(prompt, output) is
    not ok (at most rounds + 1 attempts). Chosen: the first accepted attempt, else the last.
    Every attempt is a candidate (score 1 accepted / 0 not; note = the feedback message)."""
    check_int("rounds", rounds, 0)
    params = params or SamplingParams()
    budget = budget if budget is not None else Budget()
    candidates: list[Candidate] = []
    request, kept, stopped = prompt, "", False
    for attempt in range(rounds + 1):
        if budget.exhausted:
            stopped = True
            break
        seed = params.seed if attempt == 0 else derive_seed(params.seed, "refine", attempt)
        [[completion]] = call_generator(generator, [request], 1, params.replace(seed=seed), budget)
        output = kept + completion.text
        budget.add_scorer_calls()
        verdict = as_feedback(feedback(prompt, output), attempt)
        answer = extract(output) if extract is not None else None
        candidates.append(Candidate(output, completion, float(verdict.ok), answer, note=verdict.message))
        if verdict.ok:
            break
        if verdict.keep is not None:
            request, kept = prompt + verdict.keep, verdict.keep
        else:
            request, kept = template.format(prompt=prompt, previous=output, feedback=verdict.message), ""
    accepted = [c for c in candidates if c.score == 1.0]
    chosen = accepted[0] if accepted else (candidates[-1] if candidates else None)
    tallies = {"accepted": bool(accepted), "attempts": len(candidates)}
    answer = chosen.answer if chosen is not None else None
    return MetaResult("refine", chosen, candidates, budget.report(), answer, tallies, stopped)
