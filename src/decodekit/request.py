"""The request model every decoder runs: requests, their rows, sampling and streaming a step.

    make_requests(model, prompts, params) -> list[Request]   (one per prompt, n rows each)
    sample_rows(logits [R, V], rows) -> tokens [R]           (chain, selector, record)
    emit(rows, context) -> Delta, ...                        (text deltas with their tokens'
                                                              logprobs, completions at the end)

A `Request` is one prompt with its `SamplingParams`, adapter chain (with the caller's own
adapter first, if any), sampler state (its own random generator: one uniform per row per
step; every row's generated tokens) and optional token mask; its `Row`s
are its n samples. The paged engine (engine/) and the plain loop (decode/sample.py) run
the same objects, so a request's tokens, logprobs and finish reasons are decided here,
once, whichever of them computes its logits. This module sits below both: it imports
models' contract, sampling and params, never a decoder or the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from decodekit.completion import Completion, Usage
from decodekit.models.base import LanguageModel
from decodekit.params import TRUNCATE_RULE, SamplingParams
from decodekit.sampling import SamplerState, build_chain, select_tokens
from decodekit.sampling.chain import Chain, compacting
from decodekit.sampling.processors import argmax_rows, temperature, topk_rows
from decodekit.sampling.select import chosen_logprobs, draw_logits_rows, fused_normaliser, scratch_log_softmax
from decodekit.text import TextTracker

Prompt = str | Sequence[int]


class TokenMask(Protocol):
    """Per-row token filter of a request, applied before its adapter chain (the shape of
    llama.cpp's samplers: apply, accept): decode/constrained.py's `GrammarMask`,
    decode/healing.py's `HealingMask`."""

    def apply(self, logits: torch.Tensor) -> torch.Tensor: ...  # [R, V] -> [R, V]

    def accept(self, tokens: torch.Tensor | Sequence[int]) -> None: ...  # [R] chosen tokens

    def select_rows(self, rows: Sequence[int]) -> None: ...

    def is_complete(self, row: int) -> bool: ...  # after accept: must the row stop?

    def completes(self, row: int, token: int) -> bool: ...  # would `token` complete it?


# (model, prompt ids, params) -> (the request's mask or None, the prompt ids to run, how its
# generated ids read as text). decode/constrained.py's `mask_builder` makes one from a
# constraint or token healing; without one a request has no mask.
MaskBuilder = Callable[
    [LanguageModel, list[int], SamplingParams],
    tuple[TokenMask | None, list[int], Callable[[Sequence[int]], str]],
]


@dataclass
class Row:
    """One sample being generated."""

    request: Request
    sample: int
    text: TextTracker
    logprobs: list[float] = field(default_factory=list)
    processed_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)  # with params.entropies
    final_logprobs: torch.Tensor | None = None  # [V], its last step's, with params.entropies
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
    mask: TokenMask | None = None  # of the request's rows
    cached_prompt_tokens: int = 0  # of the first sample's prompt, reused from a prefix cache
    # Its adapter reads each row's final hidden state (SamplerState.hidden) of this model: a
    # decoder that computes them (the engine) hands them to `sample_rows`.
    wants_hidden: bool = False


@dataclass
class Delta:
    """A streaming event: new settled text of one sample; `completion` is set when it ends.

    `token_ids`, `logprobs` and `top_logprobs` (None unless requested) are those of the
    tokens whose text this delta completes: a token whose text is held back (a possible stop
    string, a partial character) comes with the delta that hands its text out, and the last
    delta brings every token left (the EOS, a stop string's). Over a sample's deltas they
    add up to its completion's."""

    prompt_index: int
    sample_index: int
    text: str
    completion: Completion | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] | None = None


# A text longer than this many characters per context token is encoded a prefix at a time
# (`encode_text`); real text averages 3 to 5 characters a token.
PREFIX_CHARS_PER_TOKEN = 16


def encode_text(encode: Callable[[str], list[int]], text: str, max_context: int) -> list[int]:
    """`encode(text)`, refused (ValueError) without encoding it whole when a prefix alone makes
    at least twice `max_context` tokens: a 7 MB prompt against a 512-token context costs a few KB
    of tokenising, not seconds and hundreds of MB. The prefix grows fourfold while it makes fewer
    (a text that normalises away, e.g. collapsed spaces), so the work stays within 4/3 of what the
    answer needs. Twice the context leaves room for the cut last word, which may split differently."""
    size = PREFIX_CHARS_PER_TOKEN * max_context
    while size < len(text):
        count = len(encode(text[:size]))
        if count >= 2 * max_context:
            raise ValueError(
                f"prompt is longer than the model's context of {max_context} tokens: its first {size} "
                f"characters alone make {count} tokens (of {len(text)} characters), and a prompt must "
                f"have fewer tokens than the context"
            )
        size *= 4
    return encode(text)


def kept_tokens(truncate: int | None, max_context: int) -> int | None:
    """How many of a prompt's last tokens SamplingParams.truncate_prompt_tokens (`truncate`) keeps:
    None (all), k, or the context for -1, as vLLM reads it; ValueError naming a value it refuses."""
    if truncate is None:
        return None
    if isinstance(truncate, bool) or not isinstance(truncate, int) or truncate == 0 or truncate < -1:
        raise ValueError(f"{TRUNCATE_RULE}, got {truncate!r:.80}")
    if truncate > max_context:
        raise ValueError(f"truncate_prompt_tokens must be <= the model's context of {max_context} tokens "
                         f"(or -1), got {truncate}")
    return max_context if truncate == -1 else truncate


def truncated_prompt(model: LanguageModel, prompt: Prompt, truncate: int | None = None
                     ) -> tuple[list[int], int]:
    """`encode_prompt`'s ids, and how many tokens the truncation dropped from the prompt's start."""
    keep = kept_tokens(truncate, model.max_context)
    if isinstance(prompt, str):
        # Truncation keeps the last tokens of the whole prompt's encoding, so the whole text is
        # tokenised (the server bounds it by its body size); without it, a text far past the
        # context is refused from a prefix.
        ids = list(model.encode(prompt)) if keep is not None else encode_text(model.encode, prompt,
                                                                               model.max_context)
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < model.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside [0, {model.vocab_size})")
    else:
        raise TypeError(f"a prompt must be a string or a list of token ids, got {prompt!r:.80}")
    if not ids:
        raise ValueError("prompt is empty: it must contain at least one token")
    dropped = max(len(ids) - keep, 0) if keep is not None else 0
    ids = ids[dropped:]
    if len(ids) >= model.max_context:
        raise ValueError(
            f"prompt has {len(ids)} tokens; the model's context is {model.max_context}, "
            "so a prompt must have fewer tokens than that"
            + (" (truncate_prompt_tokens keeps at most the context)" if keep is not None else "")
        )
    return ids, dropped


def encode_prompt(model: LanguageModel, prompt: Prompt, truncate: int | None = None) -> list[int]:
    """The prompt's token ids, checked against the vocabulary and the context; `truncate`
    (SamplingParams.truncate_prompt_tokens) keeps only its last k tokens first."""
    return truncated_prompt(model, prompt, truncate)[0]


def make_requests(
    model: LanguageModel,
    prompts: Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None,
    masks: MaskBuilder | None = None,
    adapter: Chain | None = None,
) -> list[Request]:
    """One request per prompt; `masks` gives each its token mask (a constraint, healing);
    `adapter` (logits, SamplerState) -> logits runs first in every request's chain; one whose
    `hidden_model` is `model` (align/controlled.py `ValueTilt` over a `HiddenValue`) marks
    the requests `wants_hidden`."""
    params_list = per_prompt_params(params, len(prompts))
    if adapter is not None and not callable(adapter):
        raise TypeError(f"adapter must be a callable (logits, SamplerState) -> logits, got {adapter!r:.80}")
    requests = []
    for index, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
        p.check_vocab(model.vocab_size)
        ids = encode_prompt(model, prompt, p.truncate_prompt_tokens)
        mask, decode = None, model.decode
        if masks is not None:
            mask, ids, decode = masks(model, ids, p)
        state = SamplerState(p, ids, p.n, model.vocab_size, model.eos_token_ids, model.tokenizer)
        request = Request(index, ids, p, state, build_chain(p, model.tokenizer, adapter), mask=mask,
                          wants_hidden=getattr(adapter, "hidden_model", None) is model)
        plain = decode == model.decode  # healing decodes through prompt context: not incremental
        request.rows = [Row(request, s, TextTracker(decode, p.stop, plain)) for s in range(p.n)]
        requests.append(request)
    return requests


def per_prompt_params(params, count: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: None (the defaults) or one object for all, or a list."""
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if not all(isinstance(p, SamplingParams) for p in params):
        raise TypeError(f"params must be a SamplingParams or a list of them, got {params!r:.80}")
    if len(params) != count:
        raise ValueError(f"params must be one SamplingParams or one per prompt ({count}), got {len(params)}")
    return params


def sample_rows(logits: torch.Tensor, live: list[Row], hidden: torch.Tensor | None = None) -> torch.Tensor:
    """Apply each request's chain and selector to its rows (contiguous in `live`); record tokens.
    hidden [R, H]: the final hidden states the logits came from, set as the state's `hidden`
    of each request that `wants_hidden` (None elsewhere) while its chain runs.

    Neighbouring requests whose chains compute the same row-wise function (chain.py
    `rowwise_key`: equal settings, no history or state read) run as one batch: one chain call,
    one softmax and one search, each request's uniforms from its own generator, so every row
    gets the token it would get alone (tests/test_request.py). Chains that go on with a
    top-k's kept tokens at this vocabulary (chain.py `compacts`) too, where every row of the
    batch can (else request by request); not those at a top-p or min-p (`compacts_apart`),
    whose kept tokens' width depends on all the rows of the call."""
    if len(live) == 0:
        return torch.empty(0, dtype=torch.long, device=logits.device)
    if live[0].request is live[-1].request:  # one request's rows (contiguous): no copies
        processed, chosen = _sample_request(logits, live[0].request, hidden)
        record(live, logits, processed, chosen, [(live[0].request, len(live))])
        return chosen
    batches = _batches(live, hidden is not None, compacting(logits))
    if len(batches) == 1:  # one batch of several requests: no copies
        sampled = _sample_batch(logits, batches[0][2])
        if sampled is not None:
            record(live, logits, *sampled, batches[0][2])
            return sampled[1]
        batches = _apart(batches[0])  # (its chain is not run on the whole batch again)
    tokens = torch.empty(len(live), dtype=torch.long, device=logits.device)
    # Each batch's processed logprobs, NaN where they are the raw ones (`record`); the processed
    # logits of every row only where mirostat's state reads them (SamplerState.accept).
    chosen_lp = torch.empty(len(live), dtype=logits.dtype, device=logits.device)
    processed_all = torch.empty_like(logits) if any(r.request.state.mu is not None for r in live) else None
    for start, stop, processed, chosen in _sampled(logits, batches, hidden):
        raw = logits[start:stop]  # [r, V]
        tokens[start:stop] = chosen
        if processed is None:  # plain greedy: the one-hot of the argmax, a logprob of 0
            chosen_lp[start:stop] = 0.0
        elif processed is raw:
            chosen_lp[start:stop] = float("nan")
        else:
            chosen_lp[start:stop] = chosen_logprobs(processed, chosen.to(raw.device).long()[:, None])
        if processed_all is not None:
            processed_all[start:stop] = processed if processed is not None else temperature(raw, 0.0)
    record(live, logits, processed_all, tokens, [pair for _, _, requests in batches for pair in requests],
           processed_chosen=chosen_lp)  # fmt: skip
    return tokens


def _sampled(logits: torch.Tensor, batches: list, hidden: torch.Tensor | None) -> Iterator[tuple]:
    """(start, stop, processed, chosen) of each batch's rows, sampled in one call, or request by
    request where its chain could not compact all of them (`_sample_batch`'s None)."""
    for batch in batches:
        start, stop, requests = batch
        sampled = _sample_batch(logits[start:stop], requests) if len(requests) > 1 else None
        if sampled is not None:
            yield start, stop, *sampled
            continue
        for start, stop, [(request, _)] in _apart(batch):
            part = None if hidden is None else hidden[start:stop]
            yield start, stop, *_sample_request(logits[start:stop], request, part)


def _apart(batch: tuple[int, int, list]) -> list[tuple[int, int, list]]:
    """A batch (start, stop, [(request, rows)]) as one batch per request."""
    start, _, requests = batch
    out = []
    for request, rows in requests:
        out.append((start, start + rows, [(request, rows)]))
        start += rows
    return out


def _batches(
    live: list[Row], with_hidden: bool, compact_apart: bool = False
) -> list[tuple[int, int, list[tuple[Request, int]]]]:
    """(start, stop, [(request, rows)]) runs of `live`: each request's rows, and neighbouring
    requests merged where their chains are the same row-wise function (`sample_rows`), but
    not chains that compact when `compact_apart` (rows chain.py `compacting` accepts)."""
    runs: list[tuple[int, int, list[tuple[Request, int]]]] = []
    key_of_last = None
    for start, stop in request_runs(live):
        request = live[start].request
        key = getattr(request.chain, "rowwise_key", None)
        if request.mask is not None or (with_hidden and request.wants_hidden):
            key = None
        if compact_apart and getattr(request.chain, "compacts_apart", False):
            key = None
        if key is not None and key == key_of_last:
            first, _, members = runs[-1]
            runs[-1] = (first, stop, members + [(request, stop - start)])
        else:
            runs.append((start, stop, [(request, stop - start)]))
        key_of_last = key
    return runs


def request_runs(live: list[Row]) -> Iterator[tuple[int, int]]:
    """(start, stop) of each request's rows in `live`, where a request's rows are contiguous."""
    start = 0
    while start < len(live):
        stop = start + 1
        while stop < len(live) and live[stop].request is live[start].request:
            stop += 1
        yield start, stop
        start = stop


def _sample_batch(raw: torch.Tensor, requests: list[tuple[Request, int]]) -> tuple[torch.Tensor, ...] | None:
    """Several requests' rows [R, V] through their common row-wise chain: processed logits
    and tokens [R] (`record` advances each request's state). None where the chain compacts
    at this vocabulary (a top-k's: chain.py `compacts_apart`) but some row could not: each row
    compacts alone exactly where it does in a batch of rows that all do, so the caller then
    samples the requests apart."""
    first = requests[0][0]
    if getattr(first.chain, "argmax_only", False):  # plain greedy: no processed logits (`record`)
        return None, argmax_rows(raw)
    processed = raw if first.chain.identity else first.chain(raw, first.state)
    if getattr(first.chain, "compacts", False) and compacting(raw) and not hasattr(processed, "kept"):
        return None
    if first.params.greedy:
        chosen = argmax_rows(processed)
    else:
        chosen = draw_logits_rows(processed, [(request.state.generator, rows) for request, rows in requests])
    for request, _ in requests:
        request.state.hidden = None
    return processed, chosen


def _sample_request(raw: torch.Tensor, request: Request, hidden: torch.Tensor | None) -> tuple:
    """One request's rows [r, V] (hidden [r, H] or None): processed logits and tokens [r]
    (`record` advances its state and mask). A chain without adapters samples from the raw
    logits themselves."""
    if request.mask is None and getattr(request.chain, "argmax_only", False):
        return None, argmax_rows(raw)  # plain greedy: no processed logits (`record`)
    # The token mask comes first, so the chain renormalises over the allowed tokens.
    allowed = raw if request.mask is None else request.mask.apply(raw)
    request.state.hidden = hidden if hidden is not None and request.wants_hidden else None
    identity = request.mask is None and getattr(request.chain, "identity", False)
    processed = allowed if identity else request.chain(allowed, request.state)
    chosen = select_tokens(processed, request.state)  # [r]
    return processed, chosen


def record(rows: list[Row], raw: torch.Tensor, processed: torch.Tensor | None, chosen: torch.Tensor,
           accepting: list[tuple[Request, int]] = (),
           processed_chosen: torch.Tensor | None = None):  # fmt: skip
    """Append each row's token and logprobs, and end the rows it finishes. The rows may
    belong to several requests (each request's rows contiguous, in its state's order); the
    log-softmaxes run once over the whole batch. processed None: plain greedy, the chosen
    tokens' one-hot (a processed logprob of 0). processed_chosen [R]: the rows' processed
    logprobs found already (NaN: the raw one), `processed` then only what mirostat reads or
    None. accepting: (request, rows) in the rows' order whose state and mask accept the tokens
    here, from the one host read of the step (a caller that accepted them itself passes none)."""
    index = chosen.to(raw.device).long()[:, None]  # the tokens may be on the CPU, logits not
    entropies_asked = any(row.request.params.entropies for row in rows)
    top = min(max(row.request.params.logprobs or 0 for row in rows), raw.shape[-1])
    # the rows' whole log-softmax [R, V] only where entropies or top logprobs read it (a scratch
    # slot of its own, not `chosen_logprobs`' below; read here only, the final row copied)
    raw_lp = scratch_log_softmax(raw, "whole logprobs") if entropies_asked or top else None
    # One read of the step's numbers on the host (a device synchronisation): each row's
    # token, its two logprobs (a one-hot's is 0: not read) and, when asked, its entropy and
    # top logprobs, as float64 (ids are exact).
    # (the chosen token's raw logprob from the same op whether or not the whole row is read)
    whole = raw_lp is not None and not fused_normaliser(raw)
    columns = [index[:, 0], raw_lp.gather(-1, index)[:, 0] if whole else chosen_logprobs(raw, index)]
    if processed_chosen is not None:
        columns.append(torch.where(processed_chosen.isnan(), columns[1], processed_chosen))
    elif processed is raw:
        columns.append(columns[1])
    elif processed is not None:
        columns.append(chosen_logprobs(processed, index))
    entropy_at = len(columns)
    if entropies_asked:
        columns.append(raw_entropy(raw_lp))
    top_at = len(columns)
    if top:
        values, ids = topk_rows(raw_lp, top)  # [R, k]
        columns += [*ids.T, *values.T]
    host = torch.stack([column.double() for column in columns]).tolist()  # [C, R]
    tokens, raw_chosen = [int(t) for t in host[0]], host[1]
    processed_lps = host[2] if processed is not None or processed_chosen is not None else [0.0] * len(tokens)
    entropies = host[entropy_at] if top_at > entropy_at else None
    at = 0
    for request, count in accepting:
        drawn_from = None if processed is None else processed[at : at + count]
        request.state.accept(tokens[at : at + count], drawn_from)
        if request.mask is not None:
            request.mask.accept(tokens[at : at + count])
        at += count
    local = 0
    for i, (row, token) in enumerate(zip(rows, tokens, strict=True)):
        local = local + 1 if i > 0 and rows[i - 1].request is row.request else 0
        request = row.request
        params, mask = request.params, request.mask
        row.logprobs.append(raw_chosen[i])
        row.processed_logprobs.append(processed_lps[i])
        if params.logprobs:
            k = min(params.logprobs, top)
            row.top_logprobs.append({int(host[top_at + j][i]): host[top_at + top + j][i] for j in range(k)})
        if params.entropies:
            row.entropies.append(entropies[i])
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
        if params.entropies and row.finish_reason is not None:
            row.final_logprobs = raw_lp[i].clone()  # [V]


def raw_entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """[R] entropy (nats) of each row of log-probs [R, V]; a -inf entry contributes 0."""
    return -(logprobs.exp() * logprobs).nan_to_num(nan=0.0).sum(-1)


def drop_finished_rows(live: list[Row]) -> None:
    """Shrink each request's sampler state to its rows that are still live (a request none
    of whose rows ended keeps its state as it is)."""
    for start, stop in request_runs(live):  # a request's rows, in its state's order
        request = live[start].request
        rows = [i for i in range(stop - start) if live[start + i].finish_reason is None]
        if len(rows) < stop - start:
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
        usage=Usage(len(request.prompt_ids), len(row.token_ids),
                    request.cached_prompt_tokens if row.sample == 0 else 0),
        top_logprobs=row.top_logprobs if request.params.logprobs else None,
        stop_reason=row.stop_reason,
        entropies=row.entropies if request.params.entropies else None,
        final_logprobs=row.final_logprobs,
    )


def next_delta(row: Row) -> Delta:
    """The row's text settled since its last delta, with its tokens (all the rest once it ended)."""
    done = row.finish_reason is not None
    first = row.text.emitted_tokens
    piece = row.text.delta(final=done)
    span = slice(first, row.text.emitted_tokens)
    return Delta(row.request.index, row.sample, piece, to_completion(row) if done else None,
                 row.token_ids[span], row.logprobs[span],
                 row.top_logprobs[span] if row.request.params.logprobs else None)


def cancel_rows(rows: list[Row]) -> list[Delta]:
    """End the unfinished rows with finish_reason "cancelled": their last deltas (a cancelled
    sampling request's, or a program's that samples rows: contrastive, speculative)."""
    live = [row for row in rows if row.finish_reason is None]
    for row in live:
        row.finish_reason = "cancelled"
    return [next_delta(row) for row in live]


def emit(rows: list[Row], context: int) -> Iterator[Delta]:
    """After a step: end the rows whose context window is full; the deltas of `rows`."""
    for row in rows:
        delta = step_delta(row, context)
        if delta is not None:
            yield delta


def step_delta(row: Row, context: int) -> Delta | None:
    """`emit` for one row: its delta after a step, or None when it has nothing to hand out."""
    if row.finish_reason is None and len(row.request.prompt_ids) + len(row.text.ids) >= context:
        row.finish_reason = "length"  # the context window is full
    delta = next_delta(row)
    return delta if delta.text or delta.completion is not None else None
