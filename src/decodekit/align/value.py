"""Prefix value functions for controlled decoding (Mudgal et al. 2024, seed 000).

V(prefix) estimates the expected reward of completing `prefix` with the base policy p.
`PrefixValue` is a small model over token ids, fast on CPU: an embedding bag (sum of the
completion's token embeddings), the embedding of the last token and the position, through
a two-layer MLP. Adding one token z only adds its embedding, so V(prefix + z) for all
top-k candidates z is one batched MLP call (`child_values`), which is what token-wise
controlled decoding needs at every step (align/controlled.py `ValueTilt`); `prefix_values`
scores whole prefixes, what blockwise controlled decoding needs (align/blockwise.py).
Both take each row's tokens as a list (rows may differ in length).

Training, on samples of the base policy (`BaseSamples`):
- CD-FUDGE (`train_fudge`): regress V(x_<t) onto the sample's final reward r(x) for every t.
  The least-squares solution is E_p[r | prefix], the value of the prefix.
- CD-Q (`train_cdq`): regress V(x_<t) onto sum_z p(z | x_<t) V(x_<t + z) with the target
  under stop-gradient, and V(x) onto r(x) for the full sequence (the "EOS" of a fixed-length
  completion). Its fixed point is the backward recursion V = E_p[V(child)]; `cdq_fixed_point`
  computes it on a tabular tree. Children beyond the stored top-k of p are ignored
  (renormalised), exact when top-k covers the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["BaseSamples", "PrefixValue", "cdq_fixed_point", "cdq_targets", "train_cdq", "train_fudge"]


@dataclass
class BaseSamples:
    """Completions of the base policy and what training needs about them.

    tokens [N, L] long; rewards [N] float; child_ids / child_logp [N, L, k]: the top-k
    next tokens of p before each position and their log-probabilities (for CD-Q); hidden
    [N, L, H]: the base model's state before each position (for a Q head, align/qvalue.py).
    """

    tokens: torch.Tensor
    rewards: torch.Tensor
    child_ids: torch.Tensor | None = None
    child_logp: torch.Tensor | None = None
    hidden: torch.Tensor | None = None


class PrefixValue(nn.Module):
    """V(prefix) = MLP([sum of embeddings / scale, embedding of last token, t / scale])."""

    def __init__(self, vocab_size: int, dim: int = 16, hidden: int = 64, scale: float = 32.0):
        super().__init__()
        if vocab_size < 1 or dim < 1 or hidden < 1 or scale <= 0:
            raise ValueError(f"vocab_size, dim, hidden must be >= 1 and scale > 0, got "
                             f"{vocab_size}, {dim}, {hidden}, {scale}")
        self.scale = float(scale)
        self.bag = nn.Embedding(vocab_size, dim)
        self.last = nn.Embedding(vocab_size + 1, dim)  # index vocab_size: empty prefix
        self.start = vocab_size
        nn.init.normal_(self.bag.weight, std=0.1)
        nn.init.normal_(self.last.weight, std=0.1)
        self.mlp = nn.Sequential(nn.Linear(2 * dim + 1, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def _head(self, bag: torch.Tensor, last: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        feats = torch.cat([bag / self.scale, self.last(last), (t / self.scale)[..., None]], dim=-1)
        return self.mlp(feats)[..., 0]

    def prefix_states(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Bag sums [N, L+1, D], last tokens [N, L+1] and lengths [N, L+1] of every prefix."""
        n, length = tokens.shape
        emb = self.bag(tokens)  # [N, L, D]
        bag = torch.cat([emb.new_zeros(n, 1, emb.shape[-1]), emb.cumsum(dim=1)], dim=1)
        last = torch.cat([tokens.new_full((n, 1), self.start), tokens], dim=1)  # [N, L+1]
        t = torch.arange(length + 1, dtype=emb.dtype).expand(n, -1)  # [N, L+1]
        return bag, last, t

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """V of every prefix of tokens [N, L] (the empty one included) -> [N, L+1]."""
        return self._head(*self.prefix_states(tokens))

    def _child_head(self, bag: torch.Tensor, t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """V(prefix + z) for prefixes given by bag [..., D] and length t [...], ids [..., k]."""
        child_bag = bag[..., None, :] + self.bag(ids)  # [..., k, D]
        return self._head(child_bag, ids, (t + 1)[..., None].expand(ids.shape).to(bag.dtype))

    def _bags(self, prefixes: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Bag sums [B, D] and lengths [B] of token lists of any lengths."""
        lengths = torch.tensor([len(p) for p in prefixes], dtype=torch.long)
        flat = torch.tensor([z for p in prefixes for z in p], dtype=torch.long)
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
        bag = F.embedding_bag(flat, self.bag.weight, offsets, mode="sum")  # an empty prefix: 0
        return bag, lengths.to(bag.dtype)

    def child_values(self, prefixes: Sequence[Sequence[int]], ids: torch.Tensor) -> torch.Tensor:
        """V(prefix + z) of each row's tokens `prefixes[r]` and candidates ids [B, k]: [B, k]."""
        bag, t = self._bags(prefixes)
        return self._child_head(bag, t, ids)

    def prefix_values(self, prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        """V of each whole prefix (token lists of any lengths): [B]."""
        bag, t = self._bags(prefixes)
        last = torch.tensor([p[-1] if len(p) else self.start for p in prefixes], dtype=torch.long)
        return self._head(bag, last, t)


def cdq_targets(value: PrefixValue, samples: BaseSamples) -> torch.Tensor:
    """CD-Q regression targets [N, L+1] (no gradient): E_p[V(child)] before the end, r at it."""
    if samples.child_ids is None or samples.child_logp is None:
        raise ValueError("CD-Q needs child_ids and child_logp (the top-k of p at every position)")
    inner = []
    with torch.no_grad():
        for rows in torch.arange(len(samples.tokens)).split(256):  # bounds the [n, L, k, hidden] MLP
            bag, _, t = value.prefix_states(samples.tokens[rows])
            probs = torch.softmax(samples.child_logp[rows], dim=-1)  # [n, L, k], renormalised top-k
            child_v = value._child_head(bag[:, :-1], t[:, :-1], samples.child_ids[rows])  # [n, L, k]
            inner.append((probs * child_v).sum(dim=-1))  # [n, L]
    inner = torch.cat(inner)
    return torch.cat([inner, samples.rewards[:, None].to(inner.dtype)], dim=1)


def _fit(value: PrefixValue, samples: BaseSamples, steps: int, lr: float, cdq: bool,
         refresh: int, on_progress: Callable[[float], None] | None) -> list[float]:
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if lr <= 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    rewards = samples.rewards.to(torch.float32)
    target = rewards[:, None].expand(-1, samples.tokens.shape[1] + 1)  # FUDGE: r for every t
    opt = torch.optim.Adam(value.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        if cdq and step % refresh == 0:
            target = cdq_targets(value, samples)  # stop-gradient target, refreshed
        loss = ((value(samples.tokens) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if on_progress is not None:
            on_progress((step + 1) / steps)
    return losses


def train_fudge(value: PrefixValue, samples: BaseSamples, steps: int = 300, lr: float = 1e-2,
                on_progress: Callable[[float], None] | None = None) -> list[float]:
    """CD-FUDGE: every prefix of a base sample regressed onto the sample's reward. Losses.
    `on_progress`: the share of the steps done, after each."""
    return _fit(value, samples, steps, lr, cdq=False, refresh=1, on_progress=on_progress)


def train_cdq(value: PrefixValue, samples: BaseSamples, steps: int = 300, lr: float = 1e-2,
              refresh: int = 10, on_progress: Callable[[float], None] | None = None) -> list[float]:
    """CD-Q: V(prefix) regressed onto E_p[V(prefix + z)] (target refreshed every `refresh`
    steps, stop-gradient) and the full sequence onto its reward. Losses. `on_progress`: the
    share of the steps done, after each."""
    if refresh < 1:
        raise ValueError(f"refresh must be >= 1, got {refresh}")
    return _fit(value, samples, steps, lr, cdq=True, refresh=refresh, on_progress=on_progress)


def cdq_fixed_point(policy, reward, depth: int, iterations: int | None = None) -> dict:
    """Tabular CD-Q: iterate V(prefix) <- sum_z p(z|prefix) V(prefix+z), V(leaf) = r(leaf).

    policy(prefix tuple) -> {token: prob}; reward(leaf tuple) -> float. Every prefix of
    length <= depth is a table entry. Returns {prefix: value}. With `iterations` >= depth the
    Jacobi iteration has reached the backward recursion exactly (information flows up one
    level per sweep).
    """
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    levels = [[()]]
    for _ in range(depth):
        levels.append([pre + (z,) for pre in levels[-1] for z in policy(pre)])
    table = {pre: 0.0 for level in levels for pre in level}
    for _ in range(depth + 1 if iterations is None else iterations):
        new = {}
        for pre in table:
            if len(pre) == depth:
                new[pre] = float(reward(pre))
            else:
                new[pre] = sum(q * table[pre + (z,)] for z, q in policy(pre).items())
        table = new
    return table
