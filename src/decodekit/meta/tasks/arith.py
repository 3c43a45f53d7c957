"""A verifiable multi-step arithmetic task (seed 001's "solve a math problem" setting).

A problem is an integer expression with 2-4 operations, e.g. `17+4*3-8`; the prompt is

    Compute: 17+4*3-8=

and a solution reduces it one operation per step, then states the answer:

    4*3=12
    17+12=29
    29-8=21
    Answer: 21

Because every step is checkable, the task has an exact outcome reward (`check_answer`) and an
exact process reward (`check_steps`: is every step so far a correct reduction?), the oracle
verifier v(y) of seed 001 and the programmatic counterpart of a process reward model
(Uesato et al. 2022; Lightman et al. 2024). `load_orm` / `load_prm` return the learned,
imperfect reward models trained on the embedded `arith` model's own samples.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

OPERATORS = "+-*"
DELIMITER = "\n"  # the step delimiter of the embedded `arith` model
PROMPT_PREFIX = "Compute: "
ANSWER_PREFIX = "Answer:"
_EXPRESSION = re.compile(r"^\d+(?:[+\-*]\d+)+$")
_STEP = re.compile(r"^\s*(-?\d+)\s*([+\-*])\s*(-?\d+)\s*=\s*(-?\d+)\s*$")
_ANSWER = re.compile(r"Answer:\s*(-?\d+)")


@dataclass(frozen=True)
class ArithConfig:
    """Problem difficulty: operations per problem in [min_ops, max_ops], operands in
    [1, max_operand]."""

    min_ops: int = 2
    max_ops: int = 4
    max_operand: int = 20

    def __post_init__(self):
        if not 1 <= self.min_ops <= self.max_ops:
            raise ValueError(f"need 1 <= min_ops <= max_ops, got {self.min_ops}, {self.max_ops}")
        if self.max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")


@dataclass(frozen=True)
class Problem:
    numbers: tuple[int, ...]
    ops: tuple[str, ...]

    @property
    def question(self) -> str:
        parts = [str(self.numbers[0])]
        for op, number in zip(self.ops, self.numbers[1:]):
            parts += [op, str(number)]
        return "".join(parts)

    @property
    def answer(self) -> int:
        return solve(self)[-1][3]


def generate_problems(n: int, seed: int, config: ArithConfig | None = None) -> list[Problem]:
    """n problems drawn with `random.Random(seed)`: the same seed gives the same problems."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    config = config or ArithConfig()
    rng = random.Random(seed)
    problems = []
    for _ in range(n):
        n_ops = rng.randint(config.min_ops, config.max_ops)
        numbers = tuple(rng.randint(1, config.max_operand) for _ in range(n_ops + 1))
        problems.append(Problem(numbers, tuple(rng.choice(OPERATORS) for _ in range(n_ops))))
    return problems


def parse_question(question: str | Problem) -> Problem:
    """A Problem from `17+4*3-8`, `17+4*3-8=` or a whole prompt `Compute: 17+4*3-8=\\n`."""
    if isinstance(question, Problem):
        return question
    text = question.strip().removeprefix(PROMPT_PREFIX.strip()).strip().removesuffix("=")
    text = text.replace(" ", "")
    if not _EXPRESSION.match(text):
        raise ValueError(f"not an arithmetic question (digits and + - *): {question!r}")
    numbers = tuple(int(x) for x in re.split(r"[+\-*]", text))
    return Problem(numbers, tuple(re.findall(r"[+\-*]", text)))


def format_prompt(question: str | Problem, delimiter: str = DELIMITER) -> str:
    return f"{PROMPT_PREFIX}{parse_question(question).question}={delimiter}"


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def solve(problem: Problem) -> list[tuple[int, str, int, int]]:
    """Canonical steps (a, op, b, result): leftmost `*` first, then left to right."""
    numbers, ops = list(problem.numbers), list(problem.ops)
    steps = []
    while ops:
        i = ops.index("*") if "*" in ops else 0
        result = _apply(numbers[i], ops[i], numbers[i + 1])
        steps.append((numbers[i], ops[i], numbers[i + 1], result))
        numbers[i : i + 2] = [result]
        del ops[i]
    return steps


def format_solution(question: str | Problem, delimiter: str = DELIMITER) -> str:
    """The reference solution: one step per line, then `Answer: N`."""
    problem = parse_question(question)
    lines = [f"{a}{op}{b}={r}" for a, op, b, r in solve(problem)]
    return delimiter.join(lines + [f"{ANSWER_PREFIX} {problem.answer}"])


def split_steps(solution: str, delimiter: str = DELIMITER) -> list[str]:
    """Non-empty steps of a solution, the answer line included."""
    return [s.strip() for s in solution.split(delimiter) if s.strip()]


def extract_answer(solution: str) -> int | None:
    """The integer of the first `Answer: N`, or None when there is none."""
    match = _ANSWER.search(solution)
    return int(match.group(1)) if match else None


def check_answer(question: str | Problem, solution: str) -> bool:
    """Outcome reward: the stated answer equals the true value."""
    return extract_answer(solution) == parse_question(question).answer


def _allowed(ops: Sequence[str], i: int) -> bool:
    """May operation i be reduced now? `*` always; `+`/`-` only when no `*` touches its
    operands and the operation on its left is absent or `+` (a-b+c is not a-(b+c))."""
    if ops[i] == "*":
        return True
    left_ok = i == 0 or ops[i - 1] == "+"
    return left_ok and (i + 1 == len(ops) or ops[i + 1] != "*")


def check_steps(
    question: str | Problem, steps: str | Sequence[str], delimiter: str = DELIMITER
) -> list[bool]:
    """Process reward: entry t is True iff steps 0..t are all correct.

    `steps` is a list of steps or a whole solution, split at `delimiter`.
    A step `a op b=c` is correct when c is a op b and `a op b` is an operation the expression
    reached so far may reduce next (any order that respects precedence and left
    associativity, not only the canonical one). `Answer: N` is correct when N is the true
    value. Anything else, and anything after the answer, is incorrect.
    """
    if isinstance(steps, str):
        steps = split_steps(steps, delimiter)
    problem = parse_question(question)
    states = {(problem.numbers, problem.ops)}  # expressions consistent with the steps so far
    labels, ok, answered = [], True, False
    for step in steps:
        if ok and not answered:
            answer = _ANSWER.fullmatch(step.strip())
            if answer:
                ok, answered = int(answer.group(1)) == problem.answer, True
            else:
                states = _reduce(states, step)
                ok = bool(states)
        else:
            ok = False
        labels.append(ok)
    return labels


def _reduce(states: set, step: str) -> set:
    """The expressions reachable from `states` by the reduction `step` (empty if it is wrong)."""
    match = _STEP.match(step)
    if not match:
        return set()
    a, op, b, result = int(match.group(1)), match.group(2), int(match.group(3)), int(match.group(4))
    if _apply(a, op, b) != result:
        return set()
    reached = set()
    for numbers, ops in states:
        for i in range(len(ops)):
            if ops[i] == op and numbers[i] == a and numbers[i + 1] == b and _allowed(ops, i):
                reached.add((numbers[:i] + (result,) + numbers[i + 2 :], ops[:i] + ops[i + 1 :]))
    return reached


# ---------------------------------------------------------------- learned reward models


def load_orm(name_or_path: str = "arith-orm", policy=None) -> Callable[[str, str], float]:
    """A learned outcome reward model (a probe, or a Hugging Face ORM such as
    scripts/build_arith_reward_models.py writes): (question, solution) -> score, the
    solution one segment. `orm.score_many(question, solutions)` scores many in one call;
    `orm.score_kind` says whether a score is a probability or a logit (meta/scorers.py);
    `orm.reward_model` is the model itself. policy: the LanguageModel that generates the
    solutions; a probe then also has `orm.score_completions(question, completions)`, which
    reads the log-probs that sampling with `SamplingParams(entropies=True)` computed where
    the model is the probe's policy (meta/rewards.py); best-of-N and weighted voting call it."""
    from decodekit.meta.rewards import ProbeRewardModel, load_reward_model

    scorer = load_reward_model(name_or_path)

    def score_many(question: str, solutions: Sequence[str]) -> list[float]:
        prompt = format_prompt(question)
        items = [(prompt, [solution.strip() + DELIMITER]) for solution in solutions]
        return [scores[0] for scores in scorer.score_batch(items)]

    def orm(question: str, solution: str) -> float:
        return score_many(question, [solution])[0]

    def score_completions(question: str, completions: Sequence) -> list[float]:
        prompt = format_prompt(question)
        items = [(prompt, [c.text.strip() + DELIMITER]) for c in completions]
        return [scores[0] for scores in scorer.score_batch(items, completions=completions, model=policy)]

    orm.score_many, orm.score_kind, orm.reward_model = score_many, scorer.score_kind, scorer
    if policy is not None and isinstance(scorer, ProbeRewardModel):
        orm.score_completions = score_completions
    return orm


def load_prm(name_or_path: str = "arith-prm") -> Callable[[str, list[str]], list[float]]:
    """A learned process reward model: (question, steps) -> one score per step so far.
    `prm.batch([(question, steps), ...])` scores many paths in one call (a tree search's
    prm_kind="batch"); both carry the model's `score_kind`."""
    from decodekit.meta.rewards import load_reward_model

    scorer = load_reward_model(name_or_path)

    def batch(items: Sequence[tuple[str, Sequence[str]]]) -> list[list[float]]:
        return scorer.score_batch([(format_prompt(question), [step.strip() + DELIMITER for step in steps])
                                   for question, steps in items])  # fmt: skip

    def prm(question: str, steps: list[str]) -> list[float]:
        return batch([(question, steps)])[0]

    batch.score_kind = prm.score_kind = scorer.score_kind
    prm.batch = batch
    return prm
