"""Controlled decoding (Mudgal et al. 2024; seed 000, "controlled decoding").

Given a prefix value V (align/value.py), steer the base policy p at inference time:
- token-wise (`tokenwise_cd`): z ~ p(z | prefix) exp(lam V(prefix + z)) over the top-k of p.
  Each step is the KL-regularised optimum of that step (a tilt with beta = 1/lam);
  KL(pi || p) of the sequence is measured by Monte Carlo of the log-ratios log pi/p.
- blockwise (`blockwise_cd`): draw K continuations of M tokens from p, keep the one with
  the highest V, repeat until `max_tokens`. KL <= (L/M)(log K - (K-1)/K)
  (`align.bon.blockwise_kl_bound`).

Completions have a fixed length `max_tokens` (EOS is an ordinary token here; rewards read
the decoded text). `sample_base` draws plain samples of p with the same loop and stores
what CD-Q training needs. Offline rewards: `keyword_reward`, `newline_length_reward`,
`orm_reward` (the arithmetic ORM).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from decodekit.align.value import BaseSamples, PrefixValue
from decodekit.models.base import LanguageModel, prefill
from decodekit.sampling import draw
from decodekit.validate import check_n, check_range

__all__ = [
    "Controlled",
    "blockwise_cd",
    "keyword_reward",
    "newline_length_reward",
    "orm_reward",
    "sample_base",
    "score",
    "tokenwise_cd",
]

KEYWORDS = ("love", "lord", "king", "good", "sweet", "heaven", "god", "queen", "heart", "death")


@dataclass
class Controlled:
    """Completions tokens [N, L]; for token-wise CD the Monte Carlo KL terms per sample:
    log_ratio [N] = sum_t log pi(z_t)/p(z_t) and step_kl [N] = sum_t KL(pi_t || p_t)."""

    tokens: torch.Tensor
    log_ratio: torch.Tensor | None = None
    step_kl: torch.Tensor | None = None


def _start(model: LanguageModel, prompt: Sequence[int], rows: int):
    logits, cache = prefill(model, [list(prompt)])  # [1, V]
    return logits.expand(rows, -1), cache.fork([0] * rows)


def sample_base(model: LanguageModel, prompt: Sequence[int], n: int, max_tokens: int,
                top_k: int = 64, generator: torch.Generator | None = None) -> BaseSamples:
    """n plain samples of p (temperature 1) with the top-k of p at every position.
    Rewards are left at zero: fill them with `score`."""
    check_n(n)
    check_n(max_tokens, "max_tokens")
    top_k = min(check_n(top_k, "top_k"), model.vocab_size)
    logits, cache = _start(model, prompt, n)
    tokens, child_ids, child_logp = [], [], []
    for step in range(max_tokens):
        values, ids = torch.log_softmax(logits.float(), dim=-1).topk(top_k, dim=-1)  # [N, k]
        child_ids.append(ids)
        child_logp.append(values)
        probs = torch.softmax(logits.float(), dim=-1)  # [N, V], as in blockwise_cd
        z = draw(probs, generator)  # [N]
        tokens.append(z)
        if step + 1 < max_tokens:
            logits = model.forward(z[:, None], cache)[:, -1, :]
    return BaseSamples(torch.stack(tokens, 1), torch.zeros(n), torch.stack(child_ids, 1),
                       torch.stack(child_logp, 1))


def tokenwise_cd(model: LanguageModel, value: PrefixValue, prompt: Sequence[int], n: int,
                 max_tokens: int, lam: float, top_k: int | None = 32,
                 generator: torch.Generator | None = None) -> Controlled:
    """n completions with z ∝ p(z | prefix) exp(lam V(prefix + z)) over the top-k of p
    (top_k None: the whole vocabulary; then lam = 0 is plain sampling from p)."""
    check_range("lam", lam, 0.0)
    check_n(n)
    check_n(max_tokens, "max_tokens")
    k = model.vocab_size if top_k is None else min(check_n(top_k, "top_k"), model.vocab_size)
    logits, cache = _start(model, prompt, n)
    bag = torch.zeros(n, value.bag.embedding_dim)  # [N, D]
    log_ratio, step_kl, tokens = torch.zeros(n), torch.zeros(n), []
    for step in range(max_tokens):
        logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
        top_logp, ids = logp.topk(k, dim=-1)  # [N, k]
        with torch.no_grad():
            v = value.child_values(bag, torch.full((n,), float(step)), ids) if lam > 0 else 0.0
        log_pi = torch.log_softmax(top_logp + lam * v, dim=-1)  # [N, k]
        pick = draw(log_pi.exp(), generator)[:, None]  # [N, 1]
        z = ids.gather(1, pick)[:, 0]  # [N]
        log_ratio += (log_pi.gather(1, pick) - top_logp.gather(1, pick))[:, 0]
        step_kl += (log_pi.exp() * (log_pi - top_logp)).sum(-1)
        tokens.append(z)
        with torch.no_grad():
            bag = bag + value.bag(z)
        if step + 1 < max_tokens:
            logits = model.forward(z[:, None], cache)[:, -1, :]
    return Controlled(torch.stack(tokens, 1), log_ratio, step_kl)


def blockwise_cd(model: LanguageModel, value: PrefixValue, prompt: Sequence[int], n: int,
                 max_tokens: int, k: int, m: int,
                 generator: torch.Generator | None = None) -> Controlled:
    """n completions built block by block: K samples of M tokens from p, the best by V kept."""
    check_n(k, "k")
    check_n(m, "m")
    check_n(n)
    check_n(max_tokens, "max_tokens")
    logits, cache = _start(model, prompt, n)
    done = torch.zeros(n, 0, dtype=torch.long)  # [N, t]
    while done.shape[1] < max_tokens:
        rows = [i for i in range(n) for _ in range(k)]  # K candidates per sample
        block_cache = cache.fork(rows)
        block_logits = logits[rows]  # [N*K, V]
        width = min(m, max_tokens - done.shape[1])
        block = []
        for j in range(width):
            probs = torch.softmax(block_logits.float(), dim=-1)  # [N*K, V]
            z = draw(probs, generator)  # [N*K]
            block.append(z)
            if done.shape[1] + j + 1 < max_tokens:
                block_logits = model.forward(z[:, None], block_cache)[:, -1, :]
        cand = torch.cat([done[rows], torch.stack(block, 1)], dim=1)  # [N*K, t+M]
        with torch.no_grad():
            v = value(cand)[:, -1].view(n, k)  # [N, K]
        best = [i * k + int(b) for i, b in enumerate(v.argmax(dim=1).tolist())]
        done = cand[best]
        if done.shape[1] < max_tokens:
            block_cache.select(best)
            cache, logits = block_cache, block_logits[best]
    return Controlled(done)


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


def orm_reward(question: str, orm: Callable[[str, str], float] | None = None
               ) -> Callable[[str], float]:
    """The arithmetic outcome reward model's score of a completion to `question`
    (meta/tasks/arith.py `load_orm`, loaded when `orm` is None); use with the arith model."""
    if orm is None:
        from decodekit.meta.tasks.arith import load_orm

        orm = load_orm()
    return lambda text: float(orm(question, text))


def score(model: LanguageModel, tokens: torch.Tensor, reward: Callable[[str], float]) -> torch.Tensor:
    """Rewards [N] of completions tokens [N, L], each decoded to text."""
    return torch.tensor([reward(model.decode(row)) for row in tokens.tolist()])
