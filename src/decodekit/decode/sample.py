"""Primitive generation: greedy, ancestral and adapted sampling, n samples per prompt.

    generate(model, prompts, params) -> list[list[Completion]]   (one list of n per prompt)

The loop (`_steps`) runs models without paged KV (`LanguageModel.supports_paged_kv`);
the others run on the paged engine (engine/), and so do models that run on another's
engine as programs (`LanguageModel.engine_programs`: a ContrastiveLM of paged-KV models).
All run the same requests (request.py).
The loop prefills each prompt once, forks its KV cache into the
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

from collections.abc import Iterator, Sequence

from decodekit.completion import Completion
from decodekit.decode.constrained import Constraint, mask_builder
from decodekit.decode.route import engine_route
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
    per_prompt_params,
    sample_rows,
)
from decodekit.sampling.chain import Chain


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
    requests = make_requests(model, prompts, params, mask_builder(constraint, heal), adapter)
    on_engine = engine_route(model, requests)  # an engine, or None: the plain loop (route.py)
    if on_engine is not None:
        from decodekit.engine.registry import run_requests

        yield from run_requests(*on_engine)
        return
    for rows in _steps(model, requests):
        yield from emit(rows, model.max_context)


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
    counts = [p.n for p in per_prompt_params(params, len(prompt_list))]
    results: list[list] = [[None] * n for n in counts]
    events = stream_events(model, prompt_list, params, constraint=constraint, heal=heal, adapter=adapter)
    for delta in events:
        if delta.completion is not None:
            results[delta.prompt_index][delta.sample_index] = delta.completion
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
