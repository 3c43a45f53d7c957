"""Token-wise controlled decoding (Mudgal et al. 2024; seed 000, "controlled decoding")
on the normal decoding path, and what the reward–KL frontier needs around it.

Given a prefix value V (align/value.py), steer the base policy p at inference time:
z ~ p(z | prefix) exp(lam V(prefix + z)) over the top-k of p. `ValueTilt(value, lam, top_k)`
is a sampling adapter (logits, SamplerState) -> logits that returns log p + lam V over the
top-k (-inf elsewhere). It reads each row's generated tokens from the request's
`SamplerState`, as the penalties do, so it holds no per-row state and runs wherever a
request runs. A value on the model's own hidden states (align/qvalue.py `HiddenValue`)
names that model (`hidden_model`): on the engine the step's forward then hands each row
its final state (`SamplerState.hidden`) and the value advances a per-row memory kept in
the state (`step_values`), one forward per token in all; elsewhere it recomputes the
prefix (`child_values`):

    generate(model, prompts, SamplingParams(n=64, seed=0), adapter=ValueTilt(value, 2.0))

on the paged engine or the plain loop, with the params' n, seed, max_new_tokens, stop strings
and EOS, and `Completion`s with their usage. It runs first in the request's chain, so the
params' adapters sample the tilted policy pi: temperature T samples pi^(1/T), temperature 0
is greedy controlled decoding. Each step is the KL-regularised optimum of that step (a tilt
with beta = 1/lam); KL(pi || p) of a sequence is estimated by `kl_terms`.

Blockwise controlled decoding (best-of-K blocks over a Generator) is align/blockwise.py.
`sample_base` draws plain samples of p through `generate` and adds what CD-Q training needs.
Offline rewards: `keyword_reward`, `newline_length_reward`, `orm_reward` (the arithmetic ORM),
`style_reward` (a dense one: log-likelihood per token under a model after a "style" prompt).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from decodekit.align.value import BaseSamples
from decodekit.completion import Completion
from decodekit.decode.sample import generate, stream_events
from decodekit.models.base import LanguageModel, next_token_logprobs, score_tokens
from decodekit.params import SamplingParams
from decodekit.request import Prompt, encode_prompt
from decodekit.sampling import SamplerState
from decodekit.sampling.chain import Chain
from decodekit.validate import check_n, check_range

__all__ = [
    "ChildValues",
    "ValueTilt",
    "keyword_reward",
    "kl_terms",
    "newline_length_reward",
    "orm_reward",
    "sample_base",
    "score",
    "style_reward",
]

KEYWORDS = ("love", "lord", "king", "good", "sweet", "heaven", "god", "queen", "heart", "death")


class ChildValues(Protocol):
    """V(prefix + z) for each row's tokens and candidate ids [B, k] -> [B, k] (PrefixValue, or
    align/qvalue.py's HiddenValue: Q(prefix, z)). A value may also have `hidden_model` (the
    model whose states it reads) and `step_values(state, ids) -> [R, k] | None`, the same
    values from the states a decoder handed over in `state.hidden` (None: not applicable)."""

    def child_values(self, prefixes: Sequence[Sequence[int]], ids: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, eq=False)
class ValueTilt:
    """The token-wise controlled-decoding adapter: log p + lam V(prefix + z) over the top-k of
    p (top_k None: the whole vocabulary; then lam = 0 leaves p unchanged)."""

    value: ChildValues
    lam: float
    top_k: int | None = None

    def __post_init__(self):
        if not callable(getattr(self.value, "child_values", None)):
            raise TypeError("value must have child_values(prefixes, ids) (a PrefixValue), "
                            f"got {self.value!r:.80}")
        check_range("lam", self.lam, 0.0)
        if self.top_k is not None:
            check_n(self.top_k, "top_k")

    @property
    def hidden_model(self) -> LanguageModel | None:
        """The model whose final hidden states the value reads (make_requests marks its
        requests `wants_hidden`), or None."""
        return getattr(self.value, "hidden_model", None)

    def __call__(self, logits: torch.Tensor, state: SamplerState) -> torch.Tensor:
        return self.tilt(logits, state.generated, state)

    @torch.no_grad()
    def tilt(self, logits: torch.Tensor, prefixes: Sequence[Sequence[int]],
             state: SamplerState | None = None) -> torch.Tensor:
        """Tilted logits [R, V] of logits [R, V] after the tokens `prefixes[r]` of each row
        (a request's `state`: its rows' hidden states, where the decoder handed them over)."""
        logp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
        rows, vocab = logp.shape
        every = self.top_k is None or self.top_k >= vocab  # every token a candidate: no sort
        if every:
            top_logp, ids = logp, torch.arange(vocab, device=logp.device).expand(rows, -1)
        else:
            top_logp, ids = logp.topk(self.top_k, dim=-1)  # [R, k]
        if self.lam > 0:
            v = None
            if state is not None and state.hidden is not None:
                v = self.value.step_values(state, ids)  # from the handed-over states
            if v is None:
                v = self.value.child_values(prefixes, ids.cpu())  # [R, k]
            top_logp = top_logp + self.lam * v.to(top_logp.device, top_logp.dtype)
        if every:
            return top_logp
        return torch.full_like(logp, float("-inf")).scatter(-1, ids, top_logp)


def kl_terms(model: LanguageModel, tilt: ValueTilt, prompt: Prompt, completions: Sequence[Completion],
             on_progress: Callable[[float], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Monte Carlo terms of KL(pi || p) for completions of `prompt` drawn with `tilt`:
    log_ratio [N] = sum_t log pi(z_t)/p(z_t), read from each completion's processed and raw
    logprobs (pi: the distribution each token was drawn from), and step_kl [N] = sum_t
    KL(pi_t || p_t) along its path, pi_t the tilt of p_t, recomputed in one forward over the
    paths (so the decode loop keeps no alignment bookkeeping). Both have mean KL(pi || p)
    when the params leave the tilt unchanged (temperature 1, no other adapter).
    `on_progress`: the share of the paths done, after each."""
    log_ratio = torch.tensor([sum(c.processed_logprobs) - sum(c.logprobs) for c in completions])
    prompt_ids = encode_prompt(model, prompt)
    rows = [list(c.token_ids) for c in completions]
    step_kl = torch.zeros(len(rows))
    if not any(rows):
        return log_ratio, step_kl
    paths = next_token_logprobs(model, [prompt_ids + row for row in rows], [len(prompt_ids)] * len(rows))
    for i, (row, logp) in enumerate(zip(rows, paths)):  # logp [L, V]; one path at a time bounds memory
        log_pi = torch.log_softmax(tilt.tilt(logp, [row[:t] for t in range(len(row))]), dim=-1)
        terms = torch.where(log_pi.isfinite(), log_pi.exp() * (log_pi - logp), 0.0)
        step_kl[i] = terms.sum()
        if on_progress is not None:
            on_progress((i + 1) / len(rows))
    return log_ratio, step_kl


def generate_reporting(model: LanguageModel, prompt: Prompt, params: SamplingParams, *,
                       adapter: Chain | None = None,
                       on_progress: Callable[[float], None] | None = None) -> list[Completion]:
    """`generate`'s params.n completions of one prompt (the same ones: it streams the same
    requests), calling `on_progress` with the share of the n * max_new_tokens tokens generated
    so far, as they come: a long sampling run shows its progress within."""
    if on_progress is None:
        return generate(model, [prompt], params, adapter=adapter)[0]
    completions: list = [None] * params.n
    done, whole = 0, params.n * params.max_new_tokens
    for delta in stream_events(model, [prompt], params, adapter=adapter):
        done += len(delta.token_ids)
        on_progress(done / whole)
        if delta.completion is not None:
            completions[delta.sample_index] = delta.completion
    return completions


def sample_base(model: LanguageModel, prompt: Prompt, params: SamplingParams,
                top_k: int = 64, on_progress: Callable[[float], None] | None = None) -> BaseSamples:
    """params.n samples of p through `generate`, with the top-k of p before every position
    (what CD-Q trains on; from one forward over the paths). A value trains on samples of one
    length: use ignore_eos and no stop strings. Rewards are left at zero: fill them with
    `score`. `on_progress`: the share done, from 0 to 1, as the samples and the top-k come."""
    top_k = min(check_n(top_k, "top_k"), model.vocab_size)
    sampling = None if on_progress is None else (lambda share: on_progress(0.8 * share))
    completions = generate_reporting(model, prompt, params, on_progress=sampling)
    lengths = sorted({len(c.token_ids) for c in completions})
    if len(lengths) > 1:
        raise ValueError(f"base samples must have one length to train a value on, got lengths {lengths}; "
                         "sample with ignore_eos=True and no stop strings")
    tokens = torch.tensor([c.token_ids for c in completions], dtype=torch.long)  # [N, L]
    prompt_ids = encode_prompt(model, prompt, params.truncate_prompt_tokens)  # what was sampled from
    child_logp, child_ids = [], []
    for chunk in tokens.split(64):  # bounds the [rows, T, V] log-probabilities held at once
        paths = next_token_logprobs(model, torch.cat([torch.tensor(prompt_ids).expand(len(chunk), -1),
                                                      chunk], dim=1), [len(prompt_ids)] * len(chunk))
        values, ids = torch.stack(paths).topk(top_k, dim=-1)  # [n, L, k]
        child_logp.append(values)
        child_ids.append(ids)
        if on_progress is not None:  # the top-k forwards: the last fifth
            on_progress(0.8 + 0.2 * sum(map(len, child_ids)) / len(tokens))
    return BaseSamples(tokens, torch.zeros(len(tokens)), torch.cat(child_ids), torch.cat(child_logp))


def keyword_reward(words: Sequence[str] = KEYWORDS) -> Callable[[str], float]:
    """Number of whole-word, case-insensitive occurrences of `words` in a text."""
    if not words:
        raise ValueError("words must not be empty")
    pattern = re.compile(r"\b(" + "|".join(re.escape(w) for w in words) + r")\b", re.IGNORECASE)
    return lambda text: float(len(pattern.findall(text)))


def newline_length_reward(text: str) -> float:
    """Length reward (Mudgal et al. 2024 use response length): characters before the first
    newline (the whole text if none)."""
    cut = text.find("\n")
    return float(len(text) if cut < 0 else cut)


def style_reward(model: LanguageModel, prompt: str) -> Callable[[str], float]:
    """Mean log-likelihood per token (nats) of a text under `model` after `prompt`: a dense
    reward (every token adds to it), e.g. how much a completion reads like a speaker's line
    (the Shakespeare model after "QUEEN MARGARET:\n"). The text is scored as the model
    tokenises prompt + text; an empty text has no mean and raises ValueError."""
    start = len(model.encode(prompt))

    def reward(text: str) -> float:
        ids = model.encode(prompt + text)
        if len(ids) <= start:
            raise ValueError(f"style_reward needs a non-empty text, got {text!r}")
        return float(score_tokens(model, ids, start).mean())

    return reward


def orm_reward(question: str, orm: Callable[[str, str], float] | None = None
               ) -> Callable[[str], float]:
    """The arithmetic outcome reward model's score of a completion to `question`
    (meta/tasks/arith.py `load_orm`, loaded when `orm` is None); use with the arith model."""
    if orm is None:
        from decodekit.meta.tasks.arith import load_orm

        orm = load_orm()
    return lambda text: float(orm(question, text))


def score(model: LanguageModel, tokens: torch.Tensor | Sequence[Sequence[int]],
          reward: Callable[[str], float]) -> torch.Tensor:
    """Rewards [N] of completions' tokens (a tensor [N, L] or lists), each decoded to text."""
    rows = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    return torch.tensor([reward(model.decode(row)) for row in rows], dtype=torch.float32)
