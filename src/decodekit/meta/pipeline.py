"""Pipelines of generators (seed 001's "Meta-generators | chain"; named pipeline here, since a
chain in decodekit is a request's sampling adapters, sampling/chain.py): compose generators
so one's output feeds the next, y1 ~ g1(x), y2 ~ g2(x, y1), ..., with tools between the
steps (Self-Ask, DSP: "generate query, call API, then generate an answer").

- `run_pipeline(steps, input)`: a fixed pipeline. A step reads the state (a dict holding
  "input", "last" and every earlier step's output by name) and returns text;
  `generate_step` fills a template and calls a generator, `tool_step` calls a function.
- `generate_with_tool(generator, prompt, tool)`: a tool call *inside* a generation: the
  model writes until a call marker (e.g. "4*3="), the tool evaluates the text of the line
  so far (`calculator`), its result is appended, and generation continues.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Sequence

from decodekit.meta.budget import Budget
from decodekit.meta.generator import Generator, call_generator, derive_seed
from decodekit.meta.result import Candidate, MetaResult
from decodekit.params import SamplingParams

Step = Callable[[dict[str, str], Budget], str]

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Evaluate + - * / // % and parentheses over numbers (no names, no calls, no powers)."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise ValueError(f"calculator accepts numbers, + - * / // % and parentheses: {expression!r}")

    try:
        result = value(tree.body)
    except ZeroDivisionError:
        raise ValueError(f"division by zero in {expression!r}") from None
    return str(int(result)) if float(result).is_integer() else repr(result)


def generate_step(generator: Generator, template: str, params: SamplingParams | None = None) -> Step:
    """A pipeline step that generates one completion of `template.format(**state)`."""
    params = params or SamplingParams()

    def step(state: dict[str, str], budget: Budget) -> str:
        [[completion]] = call_generator(generator, [template.format(**state)], 1, params, budget)
        return completion.text

    return step


def tool_step(tool: Callable[[str], str], template: str = "{last}") -> Step:
    """A pipeline step that calls `tool` on `template.format(**state)` (default: the last output)."""

    def step(state: dict[str, str], budget: Budget) -> str:
        budget.tool_calls += 1
        return str(tool(template.format(**state)))

    return step


def run_pipeline(steps: Sequence[tuple[str, Step]], input: str, budget: Budget | None = None) -> MetaResult:
    """Run named steps in order; each output is stored under its name and as "last". An
    exhausted budget stops the pipeline before the next step (stopped_by_budget)."""
    names = [name for name, _ in steps]
    if len(set(names)) != len(names) or {"input", "last"} & set(names):
        raise ValueError(f"pipeline step names must be unique and not 'input'/'last', got {names}")
    budget = budget if budget is not None else Budget()
    state = {"input": input, "last": input}
    candidates, stopped = [], False
    for name, step in steps:
        if budget.exhausted:
            stopped = True
            break
        state[name] = state["last"] = step(state, budget)
        candidates.append(Candidate(state[name], note=name))
    chosen = candidates[-1] if candidates else Candidate(input)
    return MetaResult("pipeline", chosen, candidates, budget.report(), tallies=dict(state),
                      stopped_by_budget=stopped)


def generate_with_tool(
    generator: Generator,
    prompt: str,
    tool: Callable[[str], str] = calculator,
    params: SamplingParams | None = None,
    *,
    call: str = "=",
    line: str = "\n",
    max_calls: int = 16,
    budget: Budget | None = None,
) -> MetaResult:
    """Generate with tool calls between steps: whenever the model writes `call`, the text of
    the current line before it goes to `tool` and `call + result` is appended; generation then
    resumes. Ends when the model stops any other way (EOS, length) or after `max_calls`.
    A tool error ends the generation, recorded as the candidate's `error`."""
    params = params or SamplingParams()
    budget = budget if budget is not None else Budget()
    step_params = params.replace(stop=(*params.stop, call))
    output, error = "", None
    for index in range(max_calls + 1):
        seed = params.seed if index == 0 else derive_seed(params.seed, "tool", index)
        [[completion]] = call_generator(generator, [prompt + output], 1, step_params.replace(seed=seed),
                                        budget)
        output += completion.text
        if completion.stop_reason != call or index == max_calls or budget.exhausted:
            break
        expression = output.rsplit(line, 1)[-1]
        budget.tool_calls += 1
        try:
            output += call + str(tool(expression)) + line
        except Exception as exc:  # the tool's failure ends this generation, reported below
            error = f"tool failed on {expression!r}: {type(exc).__name__}: {exc}"
            break
    chosen = Candidate(output, error=error)
    stopped = budget.exhausted
    return MetaResult("generate_with_tool", chosen, [chosen], budget.report(), stopped_by_budget=stopped)
