"""Beam search with length normalisation (seeds 003, 004).

Keeps the `num_beams` best prefixes by summed log-probability. Each step ranks the
2 * num_beams best continuations; one that emits EOS (or a stop token) among the top
`num_beams` of them leaves the beam with score Σ log p / |y|^α, where |y| counts
generated tokens only, the final EOS included (counting the prompt is a bug once
reported against Hugging Face). Lower-ranked EOS candidates are dropped: they only
make room for live beams, as in Hugging Face and fairseq (at the last step every
top-`num_beams` continuation finishes, with reason "length").

The adapter chain of `SamplingParams` is applied before scoring, so n-gram blocking
(`no_repeat_ngram_size`), bad words, logit bias and penalties work; temperature is
ignored (set to 1).

early_stopping=True stops once `num_beams` hypotheses have finished (the usual
choice); False stops only when no live beam can still beat the worst kept
hypothesis, which makes a wide enough beam equal exhaustive search (transformers'
early_stopping="never"; its False is a heuristic that may stop sooner).

A token mask (`constraint=` or `heal=`, as in `generate`) is applied before the chain; a
hypothesis whose constraint is complete leaves the beam like one that emits EOS.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from decodekit.completion import Completion, Usage
from decodekit.decode.constrained import Constraint, token_mask
from decodekit.models.base import LanguageModel, prefill
from decodekit.params import SamplingParams
from decodekit.request import Prompt, encode_prompt
from decodekit.sampling import SamplerState, build_chain


@dataclass
class Hypothesis:
    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)  # raw model log-probs
    scores: list[float] = field(default_factory=list)  # processed log-probs (what beam sums)
    finish_reason: str = "length"
    stop_reason: int | None = None  # the EOS or stop token that ended it

    @property
    def total(self) -> float:
        return float(sum(self.scores))

    def normalised(self, alpha: float) -> float:
        return self.total / (max(len(self.tokens), 1) ** alpha)


def beam_search(
    model: LanguageModel,
    prompts: Prompt | Sequence[Prompt],
    params: SamplingParams | None = None,
    *,
    num_beams: int = 4,
    length_penalty: float = 1.0,
    early_stopping: bool = True,
    constraint: Constraint | None = None,
    heal: bool | int = False,
) -> list[Completion] | list[list[Completion]]:
    """The `params.n` best hypotheses (n <= num_beams) per prompt, best first, with `score` set."""
    params = params or SamplingParams()
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams must be an integer >= 1, got {num_beams!r}")
    if params.n > num_beams:
        raise ValueError(f"n must be <= num_beams ({num_beams}), got {params.n}")
    if not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
    if params.stop:
        raise ValueError("beam search stops on EOS and stop_token_ids; stop strings are not supported")
    single = isinstance(prompts, str)
    prompt_list = [prompts] if single else list(prompts)
    results = []
    for prompt in prompt_list:
        mask, ids, decode = token_mask(model, encode_prompt(model, prompt), 1, constraint, heal,
                                       params.ignore_eos)
        results.append(_beam_one(model, ids, params, num_beams, length_penalty, early_stopping,
                                 mask, decode))
    return results[0] if single else results


def _beam_one(model, prompt_ids, params, num_beams, alpha, early_stopping, mask, decode):
    params = params.replace(temperature=1.0)
    params.check_vocab(model.vocab_size)
    chain = build_chain(params, model.tokenizer)
    state = SamplerState(params, prompt_ids, 1, model.vocab_size, model.eos_token_ids, model.tokenizer)
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(model.eos_token_ids))
    max_steps = min(params.max_new_tokens, model.max_context - len(prompt_ids))
    logits, cache = prefill(model, [prompt_ids])  # [1, V]
    beams = [Hypothesis([])]
    finished: list[Hypothesis] = []
    for step in range(max_steps):
        allowed = logits if mask is None else mask.apply(logits)  # the mask comes first
        processed = chain(allowed, state)  # [K, V]
        scores = torch.log_softmax(processed, dim=-1)
        raw = torch.log_softmax(logits, dim=-1)
        totals = torch.tensor([b.total for b in beams])[:, None] + scores  # [K, V]
        # 2K candidates (one more K per extra stop token, as Hugging Face keeps) leave at least
        # K that do not stop, to refill the live beams.
        width = max(2, 1 + len(stop_ids)) * num_beams
        best = totals.flatten().topk(min(width, int(torch.isfinite(totals).sum())))
        vocab = totals.shape[1]
        last = step + 1 == max_steps  # every candidate stops: out of length
        parents, tokens, next_beams = [], [], []
        for rank, flat in enumerate(best.indices.tolist()):
            parent, token = divmod(flat, vocab)
            beam = beams[parent]
            grown = Hypothesis(
                beam.tokens + [token],
                beam.logprobs + [float(raw[parent, token])],
                beam.scores + [float(scores[parent, token])],
            )
            ends = token in stop_ids and len(grown.tokens) > params.min_new_tokens or (
                mask is not None and token not in stop_ids and mask.completes(parent, token)
            )
            if ends or last:
                # A hypothesis finishes only from the top num_beams candidates (Hugging Face's
                # `_update_finished_beams`, fairseq's `finalize_hypos` over the first beam_size);
                # the candidates below are only there to refill the live beams.
                if rank < num_beams:
                    if ends:
                        grown.finish_reason = "stop"  # EOS, a stop token, or a complete constraint
                        grown.stop_reason = token if token in stop_ids else None
                    finished = _keep_best(finished + [grown], num_beams, alpha)
            elif token not in stop_ids:
                parents.append(parent)
                tokens.append(token)
                next_beams.append(grown)
            if len(next_beams) == num_beams or (last and rank + 1 == num_beams):
                break
        beams = next_beams
        if not beams or _done(finished, beams, num_beams, alpha, early_stopping, step + 1, max_steps):
            beams = []  # out of length, or stopped early: live beams cannot beat the finished ones
            break
        cache.select(parents)
        state.select_rows(parents)
        chosen = torch.tensor(tokens)
        state.accept(chosen, processed[parents])
        if mask is not None:
            mask.select_rows(parents)
            mask.accept(chosen)
        logits = model.forward(chosen[:, None], cache)[:, -1, :]  # [K, V]
    finished = _keep_best(finished + beams, num_beams, alpha)
    return [_completion(decode, h, prompt_ids, alpha) for h in finished[: params.n]]


def _keep_best(hypotheses: list[Hypothesis], num_beams: int, alpha: float) -> list[Hypothesis]:
    return sorted(hypotheses, key=lambda h: h.normalised(alpha), reverse=True)[:num_beams]


def _done(finished, beams, num_beams, alpha, early_stopping, length, max_length) -> bool:
    """Whether search can stop: enough finished hypotheses and, unless early, no live beam can win."""
    if len(finished) < num_beams:
        return False
    if early_stopping:
        return True
    worst = finished[-1].normalised(alpha)
    best_total = max(b.total for b in beams)  # log-probs are <= 0: totals only fall
    # The best a live beam can reach: its total, divided by the most favourable length.
    reach = max_length if alpha > 0 else length + 1
    return best_total / (reach**alpha) <= worst


def _completion(decode, h: Hypothesis, prompt_ids, alpha) -> Completion:
    text_ids = h.tokens[:-1] if h.stop_reason is not None else h.tokens
    return Completion(
        token_ids=h.tokens,
        text=decode(text_ids),
        logprobs=h.logprobs,
        processed_logprobs=h.scores,
        finish_reason=h.finish_reason,
        usage=Usage(len(prompt_ids), len(h.tokens)),
        stop_reason=h.stop_reason,
        score=h.normalised(alpha),
    )
