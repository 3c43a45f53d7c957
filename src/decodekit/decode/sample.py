"""Primitive generation: greedy, ancestral and adapted sampling, n samples per prompt.

    generate(model, prompts, params) -> list[list[Completion]]   (one list of n per prompt)

The loop (`_steps`) prefills each prompt once, forks its KV cache into the
request's n rows, then decodes one token per step for every live row. Each
request keeps its own adapter chain and random generator (one uniform per row per
step), so a seeded request's random stream never depends on what else is in the
batch; its logits can, by float rounding (~1e-5), unless the model computes each
row alone (NativeLM's `batch_invariant`). Finished rows leave the
batch (their cache rows are dropped) so later steps cost only the live rows.

A request may carry a token mask (`constraint=`: constrained.py; `heal=`: healing.py),
applied before its adapter chain and advanced with the chosen tokens; a row whose
constraint is complete finishes with finish_reason "stop".
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from decodekit.completion import Completion, Usage
from decodekit.decode.constrained import Constraint, token_mask
from decodekit.decode.text import TextTracker
from decodekit.models.base import LanguageModel, prefill
from decodekit.params import SamplingParams
from decodekit.sampling import SamplerState, build_chain, select_tokens

Prompt = str | Sequence[int]


@dataclass
class Row:
    """One sample being generated."""

    request: Request
    sample: int
    text: TextTracker
    logprobs: list[float] = field(default_factory=list)
    processed_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.text.ids


@dataclass
class Request:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    state: SamplerState
    chain: object
    rows: list[Row] = field(default_factory=list)
    mask: Any = None  # GrammarMask or HealingMask of the request's rows, or None


@dataclass
class Delta:
    """A streaming event: new settled text of one sample; `completion` is set when it ends."""

    prompt_index: int
    sample_index: int
    text: str
    completion: Completion | None = None


def encode_prompt(model: LanguageModel, prompt: Prompt) -> list[int]:
    if isinstance(prompt, str):
        ids = model.encode(prompt)
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < model.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside [0, {model.vocab_size})")
    else:
        raise TypeError(f"a prompt must be a string or a list of token ids, got {prompt!r:.80}")
    if not ids:
        raise ValueError("prompt is empty: it must contain at least one token")
    if len(ids) >= model.max_context:
        raise ValueError(
            f"prompt has {len(ids)} tokens; the model's context is {model.max_context}, "
            "so a prompt must have fewer tokens than that"
        )
    return ids


def make_requests(
    model: LanguageModel,
    prompts: Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None,
    constraint: Constraint | None = None,
    heal: bool | int = False,
) -> list[Request]:
    params_list = _per_prompt_params(params, len(prompts))
    requests = []
    for index, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
        p.check_vocab(model.vocab_size)
        ids = encode_prompt(model, prompt)
        mask, ids, decode = token_mask(model, ids, p.n, constraint, heal, p.ignore_eos)
        state = SamplerState(p, ids, p.n, model.vocab_size, model.eos_token_ids, model.tokenizer)
        request = Request(index, ids, p, state, build_chain(p, model.tokenizer), mask=mask)
        plain = decode == model.decode  # healing decodes through prompt context: not incremental
        request.rows = [Row(request, s, TextTracker(decode, p.stop, plain)) for s in range(p.n)]
        requests.append(request)
    return requests


def _per_prompt_params(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"params must be one SamplingParams or one per prompt ({count})")
    return params


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


def sample_rows(logits: torch.Tensor, live: list[Row]) -> torch.Tensor:
    """Apply each request's chain and selector to its rows (contiguous in `live`); record tokens."""
    tokens = torch.empty(len(live), dtype=torch.long)
    processed_all = torch.empty_like(logits)  # [R, V]
    start = 0
    while start < len(live):
        request = live[start].request
        stop = start
        while stop < len(live) and live[stop].request is request:
            stop += 1
        raw = logits[start:stop]  # [r, V]
        # The token mask comes first, so the chain renormalises over the allowed tokens.
        allowed = raw if request.mask is None else request.mask.apply(raw)
        processed = request.chain(allowed, request.state)
        chosen = select_tokens(processed, request.state)  # [r]
        request.state.accept(chosen, processed)
        if request.mask is not None:
            request.mask.accept(chosen)
        processed_all[start:stop] = processed
        tokens[start:stop] = chosen
        start = stop
    record(live, logits, processed_all, tokens)
    return tokens


def record(rows: list[Row], raw: torch.Tensor, processed: torch.Tensor, chosen: torch.Tensor):
    """Append each row's token and logprobs, and end the rows it finishes. The rows may
    belong to several requests (each request's rows contiguous, in its state's order); the
    log-softmaxes run once over the whole batch."""
    raw_lp = torch.log_softmax(raw, dim=-1)  # [R, V]
    processed_lp = torch.log_softmax(processed, dim=-1)
    index = chosen.long()[:, None]
    raw_chosen = raw_lp.gather(-1, index)[:, 0].tolist()
    processed_chosen = processed_lp.gather(-1, index)[:, 0].tolist()
    local = 0
    for i, (row, token) in enumerate(zip(rows, chosen.tolist(), strict=True)):
        local = local + 1 if i > 0 and rows[i - 1].request is row.request else 0
        request = row.request
        params, mask = request.params, request.mask
        row.logprobs.append(raw_chosen[i])
        row.processed_logprobs.append(processed_chosen[i])
        if params.logprobs:
            values, ids = raw_lp[i].topk(params.logprobs)
            row.top_logprobs.append(dict(zip(ids.tolist(), values.tolist(), strict=True)))
        if token in params.stop_token_ids or (
            token in request.state.eos_token_ids and not params.ignore_eos
        ):
            row.text.ids.append(token)
            row.finish_reason, row.stop_reason = "stop", token
        elif row.text.push(token):
            row.finish_reason, row.stop_reason = "stop", row.text.stopped_by
        elif mask is not None and mask.is_complete(local):
            row.finish_reason = "stop"  # the constraint is complete
        if row.finish_reason is None and len(row.token_ids) >= params.max_new_tokens:
            row.finish_reason = "length"


def drop_finished_rows(live: list[Row]) -> None:
    """Shrink each request's sampler state to its rows that are still live."""
    kept: dict[int, tuple[Request, list[int]]] = {}
    local = 0
    for i, row in enumerate(live):  # a request's rows are contiguous and in its state's order
        local = local + 1 if i > 0 and live[i - 1].request is row.request else 0
        _, rows = kept.setdefault(id(row.request), (row.request, []))
        if row.finish_reason is None:
            rows.append(local)
    for request, rows in kept.values():
        request.state.select_rows(rows)
        if request.mask is not None:
            request.mask.select_rows(rows)


def to_completion(row: Row) -> Completion:
    request = row.request
    text = row.text.text
    return Completion(
        token_ids=list(row.token_ids),
        text=text,
        logprobs=row.logprobs,
        processed_logprobs=row.processed_logprobs,
        finish_reason=row.finish_reason or "length",
        usage=Usage(len(request.prompt_ids), len(row.token_ids)),
        top_logprobs=row.top_logprobs if request.params.logprobs else None,
        stop_reason=row.stop_reason,
    )


def stream_events(
    model: LanguageModel,
    prompts: Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    constraint: Constraint | None = None,
    heal: bool | int = False,
) -> Iterator[Delta]:
    """Generate, yielding text deltas as tokens are accepted and a completion per sample at its end."""
    requests = make_requests(model, prompts, params, constraint, heal)
    if uses_engine(model):
        from decodekit.engine.engine import run_requests

        yield from run_requests(model, requests)
        return
    for rows in _steps(model, requests):
        yield from emit(rows, model.max_context)


def uses_engine(model: LanguageModel) -> bool:
    """Whether `generate` runs this model on the paged engine (NativeLM) or the plain loop."""
    from decodekit.models.native import NativeLM

    return isinstance(model, NativeLM)


def emit(rows: list[Row], context: int) -> Iterator[Delta]:
    """After a step: end the rows whose context window is full; the deltas of `rows`."""
    for row in rows:
        if row.finish_reason is None and len(row.request.prompt_ids) + len(row.token_ids) >= context:
            row.finish_reason = "length"  # the context window is full
        done = row.finish_reason is not None
        piece = row.text.delta(final=done)
        completion = to_completion(row) if done else None
        if piece or done:
            yield Delta(row.request.index, row.sample, piece, completion)


def generate(
    model: LanguageModel,
    prompts: Prompt | Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    constraint: Constraint | None = None,
    heal: bool | int = False,
) -> list[list[Completion]] | list[Completion]:
    """n completions per prompt. A single prompt (a string) returns its list of n completions.

    constraint: a JsonSchema, Regex, Grammar or Choices every completion must match
    (constrained.py); heal: back the prompt up over its last token (or `heal` tokens) and
    let the model re-choose it (healing.py).
    """
    single = isinstance(prompts, str)
    prompt_list = [prompts] if single else list(prompts)
    if not prompt_list:
        raise ValueError("prompts must contain at least one prompt")
    counts = [p.n for p in _per_prompt_params(params, len(prompt_list))]
    results: list[list] = [[None] * n for n in counts]
    for delta in stream_events(model, prompt_list, params, constraint=constraint, heal=heal):
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
) -> Iterator[str]:
    """Text deltas of one sample; their concatenation equals `generate(...)[0].text`."""
    params = params or SamplingParams()
    if params.n != 1:
        raise ValueError(f"stream() yields one sample, so n must be 1, got {params.n}")
    for delta in stream_events(model, [prompt], params, constraint=constraint, heal=heal):
        if delta.text:
            yield delta.text
