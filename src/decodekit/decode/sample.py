"""Primitive generation: greedy, ancestral and adapted sampling, n samples per prompt; and
where a request runs, and what a built request is, for every strategy.

    generate(model, prompts, params) -> list[list[Completion]]   (one list of n per prompt)

Sampling is the default strategy, `Sample`; `generate` and `stream` are
`Sample().prepare(...)` run to the end. Every strategy (`Sample`, beam.py `Beam`,
speculative.py `Speculative`) builds a request from its parameters in one method,
`prepare(model, prompts, params, constraint=, heal=, adapter=) -> Run`, which checks every
argument and routes it with `engine_route`. `beam_search` and `speculative_generate` are
that call and `Run.completions()` too; the CLI builds the strategy from its flags, the
server from the request's fields (and submits the run to its engine, server/backend.py
`Backend.submit`), the lab calls the same; none builds a program itself.

`engine_route(model, items, program)` is the one decision between an engine and the plain
loop, made by declared capability, never by class (models/base.py); server/backend.py keeps
an engine for exactly the models this routes to their own engine (`runs_on_own_engine`):

1. a model with paged KV (`supports_paged_kv`) runs the items on its own persistent
   engine (engine/engine.py `run_requests`): sampling requests as they are, other
   strategies' items as the programs `program(index, item)` builds (engine/program.py);
2. a model built on others runs them on the engine its `engine_programs(items)` hook names
   (a ContrastiveLM of two paged-KV models: its expert's, for sampling requests and beam
   searches), unless the strategy cannot be delegated (`delegate=False`: speculative
   decoding verifies against the target's own logits);
3. anything else runs on the plain loop (None).

The plain loop (`_steps`) runs case 3's sampling requests, the same requests (request.py)
the engine runs. It prefills each prompt once, forks its KV cache into the
request's n rows, then decodes one token per step for every live row. Each
request keeps its own adapter chain and random generator (one uniform per row per
step), so a seeded request's random stream never depends on what else is in the
batch; its logits can, by float rounding (~1e-5), unless the model computes each
row alone (NativeLM's `batch_invariant`). Finished rows leave the
batch (their cache rows are dropped) so later steps cost only the live rows.

A request may carry a token mask (`constraint=`: constrained.py; `heal=`: healing.py),
applied before its adapter chain and advanced with the chosen tokens; a row whose
constraint is complete finishes with finish_reason "stop". `adapter=` puts a caller's
own sampling adapter (logits, SamplerState) -> logits first in every request's chain:
token-wise controlled decoding is `adapter=ValueTilt(value, lam)` (align/controlled.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from decodekit.completion import Completion
from decodekit.decode.constrained import Constraint, mask_builder
from decodekit.models.base import LanguageModel, prefill
from decodekit.params import SamplingParams
from decodekit.request import (
    Delta,
    Prompt,
    Request,
    Row,
    drop_finished_rows,
    emit,
    make_requests,
    sample_rows,
)
from decodekit.sampling.chain import Chain


class UnsupportedField(ValueError):
    """A strategy cannot honour a SamplingParams field's value; `field` names it (the server
    answers 400 with it as the param)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class Run:
    """A request built by its strategy, every argument checked: `items` (its sampling
    requests, beam searches, ...; one per prompt), `counts` (the completions each prompt
    gets), `route` (`engine_route`'s answer: the model whose engine runs it and what to
    submit there) or None, and `plain()`, its deltas on the plain loop."""

    items: list
    counts: list[int]
    route: tuple[LanguageModel, list] | None
    plain: Callable[[], Iterator[Delta]]

    def deltas(self) -> Iterator[Delta]:
        """The deltas wherever the run is routed: the model's persistent engine, or the plain loop."""
        if self.route is None:
            return self.plain()
        from decodekit.engine.engine import run_requests

        return run_requests(*self.route)

    def completions(self) -> list[list[Completion]]:
        """Run it to the end: the completions of each prompt."""
        results: list[list] = [[None] * count for count in self.counts]
        for delta in self.deltas():
            if delta.completion is not None:
                results[delta.prompt_index][delta.sample_index] = delta.completion
        return results


def completion_deltas(prompt_index: int, completions: Sequence[Completion]) -> Iterator[Delta]:
    """One delta per completion of a search that produces its text at the end (beam,
    speculative decoding on the plain loop)."""
    for i, c in enumerate(completions):
        yield Delta(prompt_index, i, c.text, c, list(c.token_ids), list(c.logprobs), c.top_logprobs)


def engine_route(
    model: LanguageModel,
    items: Sequence[Any],
    program: Callable[[int, Any], Any] | None = None,
    delegate: bool = True,
) -> tuple[LanguageModel, list] | None:
    """(the model whose engine runs the items, what to submit there: requests or programs),
    or None for the plain loop (module docstring)."""
    if model.supports_paged_kv:
        if program is None:
            return model, list(items)
        return model, [program(index, item) for index, item in enumerate(items)]
    if not delegate:
        return None
    return model.engine_programs(list(items))


def runs_on_own_engine(model: LanguageModel) -> bool:
    """Whether `engine_route` runs this model's requests on the model's own engine (the
    server keeps one for exactly such a model)."""
    route = engine_route(model, [])
    return route is not None and route[0] is model


def _steps(model: LanguageModel, requests: list[Request]) -> Iterator[list[Row]]:
    """The decode loop. Yields the rows that received a token at each step."""
    logits, cache = prefill(model, [r.prompt_ids for r in requests])  # [P, V]
    parents = [i for i, r in enumerate(requests) for _ in r.rows]
    cache = cache.fork(parents)  # n rows share their prompt's prefill
    logits = logits[parents]  # [R, V]
    live = [row for r in requests for row in r.rows]
    while live:
        tokens = sample_rows(logits, live)  # [R]
        yield live
        keep = [i for i, row in enumerate(live) if row.finish_reason is None]
        if not keep:
            return
        if len(keep) < len(live):
            drop_finished_rows(live)
            cache.select(keep)
            live, tokens = [live[i] for i in keep], tokens[keep]
        logits = model.forward(tokens[:, None], cache)[:, -1, :]  # [R, V]


@dataclass(frozen=True)
class Sample:
    """The default strategy: each row's next token from the request's chain and selector."""

    def prepare(
        self,
        model: LanguageModel,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        constraint: Constraint | None = None,
        heal: bool | int = False,
        adapter: Chain | None = None,
    ) -> Run:
        """The prompts' sampling requests, routed (`engine_route`): on an engine, or the plain loop."""
        requests = make_requests(model, prompts, params, mask_builder(constraint, heal), adapter)

        def plain() -> Iterator[Delta]:
            for rows in _steps(model, requests):
                yield from emit(rows, model.max_context)

        return Run(requests, [len(r.rows) for r in requests], engine_route(model, requests), plain)


def stream_events(
    model: LanguageModel,
    prompts: Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    constraint: Constraint | None = None,
    heal: bool | int = False,
    adapter: Chain | None = None,
) -> Iterator[Delta]:
    """Generate, yielding text deltas as tokens are accepted and a completion per sample at its end."""
    run = Sample().prepare(model, prompts, params, constraint=constraint, heal=heal, adapter=adapter)
    yield from run.deltas()


def generate(
    model: LanguageModel,
    prompts: Prompt | Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    constraint: Constraint | None = None,
    heal: bool | int = False,
    adapter: Chain | None = None,
) -> list[list[Completion]] | list[Completion]:
    """n completions per prompt. A single prompt (a string) returns its list of n completions.

    constraint: a JsonSchema, Regex, Grammar or Choices every completion must match
    (constrained.py); heal: back the prompt up over its last token (or `heal` tokens) and
    let the model re-choose it (healing.py); adapter: a sampling adapter (logits [R, V],
    SamplerState) -> logits run before the params' own (after the constraint's mask), such
    as controlled decoding's value tilt (align/controlled.py `ValueTilt`).
    """
    single = isinstance(prompts, str)
    prompt_list = [prompts] if single else list(prompts)
    if not prompt_list:
        raise ValueError("prompts must contain at least one prompt")
    run = Sample().prepare(model, prompt_list, params, constraint=constraint, heal=heal, adapter=adapter)
    results = run.completions()
    return results[0] if single else results  # type: ignore[return-value]


def stream(
    model: LanguageModel,
    prompt: Prompt,
    params: SamplingParams | None = None,
    *,
    constraint: Constraint | None = None,
    heal: bool | int = False,
    adapter: Chain | None = None,
) -> Iterator[str]:
    """Text deltas of one sample; their concatenation equals `generate(...)[0].text`."""
    params = params or SamplingParams()
    if params.n != 1:
        raise ValueError(f"stream() yields one sample, so n must be 1, got {params.n}")
    for delta in stream_events(model, [prompt], params, constraint=constraint, heal=heal, adapter=adapter):
        if delta.text:
            yield delta.text
