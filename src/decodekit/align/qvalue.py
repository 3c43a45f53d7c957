"""A Q head on the base model's own hidden states (Mudgal et al. 2024, seed 000: the
paper's prefix scorer), trained by CD-Q and CD-FUDGE.

Q(s, z) estimates the expected reward of completing s + z with the base policy p, for every
next token z at once: `QHead` maps the last layer's state h(s) of the frozen base model
(`LanguageModel.hidden_states`: after the final norm, what the LM head reads) through a
small MLP to one value per vocabulary token, as the LM head maps it to logits. So:
- token-wise controlled decoding tilts p(z | s) exp(lam Q(s, z)) with one forward of the
  base model per step and none per child (`HiddenValue.child_values`, what `ValueTilt` calls);
- blockwise controlled decoding scores a candidate by the value of its last token given
  everything before it, V(prefix + block) = Q(prefix + block[:-1], block[-1])
  (`HiddenValue.prefix_values`, what `BlockwiseCD` calls): the entry that both trainings
  fit at every position, the last one included (where CD-Q's target is the reward itself).

Training, on base samples (`BaseSamples`) with `hidden` [N, L, H] = the states s_0..s_L-1 of
each sample (`add_hidden_states`), over the pairs (s_t, x_t) of the sampled paths:
- CD-FUDGE (`train_q_fudge`): Q(s_t, x_t) regressed onto the sample's reward r(x); least
  squares gives E_p[r | s_t, x_t].
- CD-Q (`train_q_cdq`): Q(s_t, x_t) regressed onto sum_z' p(z' | s_t+1) Q(s_t+1, z') under
  stop-gradient, from the next position's state and the top-k children of p that
  `sample_base` stores (renormalised), and Q(s_L-1, x_L-1) onto r(x). Its fixed point is
  the backward recursion Q(s, z) = E_p[Q(s z, .)] (`cdq_fixed_point` on a tabular tree).
Minibatch Adam over the N·L pairs; the base model stays frozen (its states are computed once).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from decodekit.align.value import BaseSamples
from decodekit.models.base import LanguageModel, left_pad, logprobs
from decodekit.request import Prompt, encode_prompt
from decodekit.validate import check_n

__all__ = ["HiddenValue", "QHead", "add_hidden_states", "q_targets", "train_q_cdq", "train_q_fudge"]


class QHead(nn.Module):
    """Q(s, .) = W2 tanh(W1 h(s) + b1) + b2: hidden states [..., H] -> values [..., V].
    W2 and b2 start at zero, so an untrained head leaves p unchanged."""

    def __init__(self, hidden_size: int, vocab_size: int, width: int = 64):
        super().__init__()
        for name, size in (("hidden_size", hidden_size), ("vocab_size", vocab_size), ("width", width)):
            check_n(size, name)
        self.inner = nn.Linear(hidden_size, width)
        self.out = nn.Linear(width, vocab_size)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inner(hidden)))


def add_hidden_states(model: LanguageModel, prompt: Prompt, samples: BaseSamples, chunk: int = 64) -> None:
    """Set samples.hidden [N, L, H]: the model's state after the prompt and the first t tokens
    of each sample, t = 0..L-1 (one forward per `chunk` samples)."""
    prompt_ids = torch.tensor(encode_prompt(model, prompt), dtype=torch.long)
    start = len(prompt_ids) - 1  # the state after the prompt is at its last token
    parts = []
    for rows in samples.tokens.split(check_n(chunk, "chunk")):
        tokens = torch.cat([prompt_ids.expand(len(rows), -1), rows[:, :-1]], dim=1)  # [n, P + L - 1]
        parts.append(model.hidden_states(tokens)[:, start:].cpu())  # [n, L, H]
    samples.hidden = torch.cat(parts)


def q_targets(head: QHead, samples: BaseSamples, rows: torch.Tensor, cols: torch.Tensor,
              cdq: bool) -> torch.Tensor:
    """Regression targets [B] (no gradient) of the pairs (s_t, x_t), t = cols, of samples
    `rows`: r(x) for FUDGE; for CD-Q E_p[Q(s_t+1, .)] before the last position, r at it."""
    reward = samples.rewards[rows].to(torch.float32)
    if not cdq:
        return reward
    length = samples.tokens.shape[1]
    after = (cols + 1).clamp(max=length - 1)  # s_t+1 (clamped where unused: t = L-1)
    with torch.no_grad():
        q = head(samples.hidden[rows, after])  # [B, V]
        probs = torch.softmax(samples.child_logp[rows, after].float(), dim=-1)  # [B, k]
        expected = (probs * q.gather(-1, samples.child_ids[rows, after])).sum(dim=-1)  # [B]
    return torch.where(cols < length - 1, expected, reward)


def _fit(head: QHead, samples: BaseSamples, cdq: bool, epochs: int, lr: float, batch_size: int,
         seed: int) -> list[float]:
    if samples.hidden is None:
        raise ValueError("samples have no hidden states: call add_hidden_states(model, prompt, samples)")
    if cdq and (samples.child_ids is None or samples.child_logp is None):
        raise ValueError("CD-Q needs child_ids and child_logp (the top-k of p at every position)")
    check_n(epochs, "epochs")
    check_n(batch_size, "batch_size")
    if lr <= 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    n, length = samples.tokens.shape
    order = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    losses = []
    for _ in range(epochs):
        total = 0.0
        for pairs in torch.randperm(n * length, generator=order).split(batch_size):
            rows, cols = pairs // length, pairs % length
            target = q_targets(head, samples, rows, cols, cdq)  # stop-gradient
            q = head(samples.hidden[rows, cols]).gather(-1, samples.tokens[rows, cols, None])[:, 0]
            loss = ((q - target) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(pairs)
        losses.append(total / (n * length))
    return losses


def train_q_fudge(head: QHead, samples: BaseSamples, epochs: int = 4, lr: float = 1e-3,
                  batch_size: int = 512, seed: int = 0) -> list[float]:
    """CD-FUDGE: Q(s_t, x_t) of every pair of every sample regressed onto the sample's
    reward. Mean loss of each epoch."""
    return _fit(head, samples, False, epochs, lr, batch_size, seed)


def train_q_cdq(head: QHead, samples: BaseSamples, epochs: int = 4, lr: float = 1e-3,
                batch_size: int = 512, seed: int = 0) -> list[float]:
    """CD-Q: Q(s_t, x_t) regressed onto E_p[Q(s_t+1, .)] (stop-gradient, the current head)
    and the last pair onto the reward. Mean loss of each epoch."""
    return _fit(head, samples, True, epochs, lr, batch_size, seed)


class HiddenValue:
    """A trained `QHead` on `model`'s states after `prompt`: the value `ValueTilt`
    (child_values) and `BlockwiseCD` (prefix_values) read. Prefixes exclude the prompt."""

    def __init__(self, model: LanguageModel, prompt: Prompt, head: QHead):
        if not isinstance(head, QHead):
            raise TypeError(f"head must be a QHead, got {type(head).__name__}")
        self.model, self.head = model, head.eval()
        self.prompt_ids = list(encode_prompt(model, prompt))

    @torch.no_grad()
    def q_values(self, prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        """Q(prompt + prefix, .) of each row: [B, V] (one forward, rows left-padded)."""
        tokens, mask = left_pad([self.prompt_ids + list(p) for p in prefixes])
        hidden = self.model.hidden_states(tokens, None if bool(mask.all()) else mask)[:, -1]  # [B, H]
        return self.head(hidden.to(self.head.out.weight.device))

    def child_values(self, prefixes: Sequence[Sequence[int]], ids: torch.Tensor) -> torch.Tensor:
        """Q(prompt + prefixes[r], ids[r]): [B, k]."""
        return self.q_values(prefixes).gather(-1, ids.to(torch.long))

    @torch.no_grad()
    def prefix_values(self, prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        """V(prefix) = Q(prefix[:-1], prefix[-1]) of each row ([B]); an empty prefix gets
        E_p[Q(prompt, .)], the expectation under the base policy."""
        q = self.q_values([p[:-1] for p in prefixes])  # [B, V]
        last = torch.tensor([p[-1] if len(p) else 0 for p in prefixes], dtype=torch.long)
        values = q.gather(-1, last[:, None])[:, 0]
        if any(len(p) == 0 for p in prefixes):
            probs = logprobs(self.model, torch.tensor([self.prompt_ids]))[0, -1].exp()  # p(. | prompt)
            empty = torch.tensor([len(p) == 0 for p in prefixes])
            values = torch.where(empty, q @ probs.to(q), values)
        return values
