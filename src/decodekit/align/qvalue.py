"""A Q head on the base model's own hidden states (Mudgal et al. 2024, seed 000: the
paper's prefix scorer), trained by CD-Q and CD-FUDGE.

Q(s, z) estimates the expected reward of completing s + z with the base policy p, for every
next token z at once: `QHead` maps the last layer's state h(s) of the frozen base model
(`LanguageModel.hidden_states`: after the final norm, what the LM head reads), with a small
memory of the completion's earlier states (a learned read-out summed over them: the frozen
state describes the next token, not what the completion has earned so far, e.g. how many
keywords it holds), through a small MLP to one value per vocabulary token, as the LM head
maps it to logits. So:
- token-wise controlled decoding tilts p(z | s) exp(lam Q(s, z)) with no forward of its own
  and none per child: on the engine the decoding forward hands each row its state h(s_t)
  (`SamplerState.hidden`) and the row keeps its memory m_t = m_t-1 + R h(s_t)
  (`HiddenValue.step_values`, what `ValueTilt` calls), so a token costs one forward, O(1),
  not a forward over the whole prefix; where no state is handed over (the plain loop, or a
  request for another prompt than the value's) `child_values` recomputes the prefix's states
  with one forward per step, O(T) tokens each;
- blockwise controlled decoding scores a candidate by the value of its last token given
  everything before it, V(prefix + block) = Q(prefix + block[:-1], block[-1])
  (`HiddenValue.prefix_values`, what `BlockwiseCD` calls): the entry both trainings fit at
  every position, the last one included (where CD-Q's target is the reward itself). (The
  sum of the completion's advantages Q(s_t, x_t) - E_p[Q(s_t, .)] telescopes to the same
  value when Q is exact, transitions being deterministic; on held-out keyword samples it
  tracked the reward worse with CD-Q: correlation 0.28 against 0.48.)

Training, on base samples (`BaseSamples`) with `hidden` [N, L, H] = the states s_0..s_L-1 of
each sample (`add_hidden_states`), over the pairs (s_t, x_t) of the sampled paths:
- CD-FUDGE (`train_q_fudge`): Q(s_t, x_t) regressed onto the sample's reward r(x); least
  squares gives E_p[r | s_t, x_t].
- CD-Q (`train_q_cdq`): Q(s_t, x_t) regressed onto sum_z' p(z' | s_t+1) Q(s_t+1, z') under
  stop-gradient, from the next position's state and the top-k children of p that
  `sample_base` stores (renormalised), and Q(s_L-1, x_L-1) onto r(x). Its fixed point is
  the backward recursion Q(s, z) = E_p[Q(s z, .)] (`cdq_fixed_point` on a tabular tree).
Minibatch Adam over the samples (all L pairs of each); the base model stays frozen (its
states are computed once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from decodekit.align.value import BaseSamples
from decodekit.models.base import LanguageModel, left_pad, logprobs
from decodekit.request import Prompt, encode_prompt
from decodekit.sampling import SamplerState
from decodekit.validate import check_n

__all__ = ["HiddenValue", "QHead", "add_hidden_states", "q_targets", "train_q_cdq", "train_q_fudge"]


class QHead(nn.Module):
    """Q(s_t, .) = W2 tanh(W1 [h(s_t), m_t] + b1) + b2, m_t = sum_{i<=t} R h(s_i): the states
    [..., T, H] of a completion (h(s_t): after the prompt and t tokens) -> values [..., T, V].
    `mask` [..., T] marks the completion's states (False: padding or prompt columns, left out
    of the memory m). W2 starts at zero and b2 at `baseline`, so an untrained head leaves p
    unchanged; pass the base samples' mean reward, so that a token no sample chose keeps
    the average value rather than 0 (which, for a reward of mean -3.4, every tilt favours)."""

    def __init__(self, hidden_size: int, vocab_size: int, width: int = 64, memory: int = 8,
                 baseline: float = 0.0):
        super().__init__()
        for name, size in (("hidden_size", hidden_size), ("vocab_size", vocab_size), ("width", width),
                           ("memory", memory)):
            check_n(size, name)
        self.read = nn.Linear(hidden_size, memory, bias=False)
        nn.init.normal_(self.read.weight, std=0.02)
        self.inner = nn.Linear(hidden_size + memory, width)
        self.out = nn.Linear(width, vocab_size)
        nn.init.zeros_(self.out.weight)
        nn.init.constant_(self.out.bias, float(baseline))

    def forward(self, states: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        read = self.read(states)  # [..., T, M]
        if mask is not None:
            read = read * mask[..., None]
        memory = read.cumsum(dim=-2)  # m_t
        return self.out(torch.tanh(self.inner(torch.cat([states, memory], dim=-1))))  # [..., T, V]


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


def q_targets(q: torch.Tensor, samples: BaseSamples, rows: torch.Tensor, cdq: bool) -> torch.Tensor:
    """Regression targets [B, L] of the pairs (s_t, x_t) of samples `rows`, given the head's
    values q [B, L, V] on their states (no gradient): r(x) at every t for FUDGE; for CD-Q
    E_p[Q(s_t+1, .)] before the last position and r at it."""
    reward = samples.rewards[rows].to(torch.float32)[:, None].expand(-1, samples.tokens.shape[1])
    if not cdq:
        return reward
    probs = torch.softmax(samples.child_logp[rows, 1:].float(), dim=-1)  # [B, L-1, k], renormalised
    expected = (probs * q[:, 1:].gather(-1, samples.child_ids[rows, 1:])).sum(dim=-1)  # [B, L-1]
    return torch.cat([expected, reward[:, -1:]], dim=1)


def _fit(head: QHead, samples: BaseSamples, cdq: bool, epochs: int, lr: float, batch_size: int,
         seed: int, on_progress: Callable[[float], None] | None) -> list[float]:
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
    for epoch in range(epochs):
        total = 0.0
        batches = torch.randperm(n, generator=order).split(max(1, batch_size // length))
        for i, rows in enumerate(batches):
            q = head(samples.hidden[rows])  # [b, L, V]
            target = q_targets(q.detach(), samples, rows, cdq)  # stop-gradient
            chosen = q.gather(-1, samples.tokens[rows, :, None])[..., 0]  # [b, L]
            loss = ((chosen - target) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(rows)
            if on_progress is not None:
                on_progress((epoch + (i + 1) / len(batches)) / epochs)
        losses.append(total / n)
    return losses


def train_q_fudge(head: QHead, samples: BaseSamples, epochs: int = 4, lr: float = 1e-3,
                  batch_size: int = 512, seed: int = 0,
                  on_progress: Callable[[float], None] | None = None) -> list[float]:
    """CD-FUDGE: Q(s_t, x_t) of every pair of every sample regressed onto the sample's
    reward. Mean loss of each epoch. `on_progress`: the share done, after each minibatch."""
    return _fit(head, samples, False, epochs, lr, batch_size, seed, on_progress)


def train_q_cdq(head: QHead, samples: BaseSamples, epochs: int = 4, lr: float = 1e-3,
                batch_size: int = 512, seed: int = 0,
                on_progress: Callable[[float], None] | None = None) -> list[float]:
    """CD-Q: Q(s_t, x_t) regressed onto E_p[Q(s_t+1, .)] (stop-gradient, the current head)
    and the last pair onto the reward. Mean loss of each epoch. `on_progress`: the share
    done, after each minibatch."""
    return _fit(head, samples, True, epochs, lr, batch_size, seed, on_progress)


class HiddenValue:
    """A trained `QHead` on `model`'s states after `prompt`: the value `ValueTilt`
    (step_values, else child_values) and `BlockwiseCD` (prefix_values) read. Prefixes exclude
    the prompt; rows are scored `chunk` at a time (one forward each, left-padded).
    `hidden_model` names the model whose states `step_values` reads (make_requests marks a
    request of that model `wants_hidden`, and the engine hands them over)."""

    def __init__(self, model: LanguageModel, prompt: Prompt, head: QHead, chunk: int = 64):
        if not isinstance(head, QHead):
            raise TypeError(f"head must be a QHead, got {type(head).__name__}")
        self.model, self.head, self.chunk = model, head.eval(), check_n(chunk, "chunk")
        self.prompt_ids = list(encode_prompt(model, prompt))

    @property
    def hidden_model(self) -> LanguageModel:
        return self.model

    def _states(self, prefixes: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The states [B, W, H] of prompt + prefix (left-padded) on the head's device and the
        completion's columns [B, W]: column j holds the state after token j; the completion's
        states (after the prompt, then after each prefix token) are its last len(prefix) + 1."""
        tokens, mask = left_pad([self.prompt_ids + list(p) for p in prefixes])
        pad = None if bool(mask.all()) else mask
        hidden = self.model.hidden_states(tokens, pad).to(self.head.out.weight.device)  # [B, W, H]
        width = tokens.shape[1]
        lengths = torch.tensor([len(p) for p in prefixes])
        states = torch.arange(width)[None, :] >= (width - 1 - lengths)[:, None]  # [B, W]
        return hidden, states.to(hidden.device)

    def _run(self, prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        """The head's values [B, W, V] over `_states`' columns: column j holds Q(state after
        token j, .)."""
        return self.head(*self._states(prefixes))

    @torch.no_grad()
    def q_values(self, prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        """Q(prompt + prefix, .) of each row: [B, V]."""
        return torch.cat([self._run(part)[:, -1] for part in _chunks(prefixes, self.chunk)])

    def child_values(self, prefixes: Sequence[Sequence[int]], ids: torch.Tensor) -> torch.Tensor:
        """Q(prompt + prefixes[r], ids[r]): [B, k], recomputing the prefixes' states."""
        return self.q_values(prefixes).gather(-1, ids.to(torch.long))

    @torch.no_grad()
    def step_values(self, state: SamplerState, ids: torch.Tensor) -> torch.Tensor | None:
        """Q(s_t, ids[r]) [R, k] of a request's rows from the states its decoder handed over
        (`state.hidden` [R, H], h(s_t) after t generated tokens), with no forward: each row's
        memory m_t = m_t-1 + R h(s_t) (QHead) is kept in `state.memory`, advanced once per call
        (the adapter runs once per sampled token). A memory that is missing or behind (states
        handed over from mid-way) is rebuilt from one recomputing forward over the prefixes.
        None where this cannot apply: no states, or a request for another prompt than this
        value's (then `child_values`)."""
        if state.hidden is None or list(state.prompt_ids) != self.prompt_ids:
            return None
        head = self.head
        hidden = state.hidden.to(head.out.weight.device, head.out.weight.dtype)  # [R, H]
        steps = len(state.generated[0])  # every row of a request has as many tokens
        key = (self, "steps")
        memory = state.memory.get(self)  # [R, M] = m_t-1
        if memory is None or not bool((state.memory[key] == steps).all()):
            memory = self._memory(state.generated).to(hidden)  # sum over s_0..s_t-1
        memory = memory + head.read(hidden)  # m_t
        state.memory[self] = memory
        state.memory[key] = torch.full((len(memory),), steps + 1, device=memory.device)
        q = head.out(torch.tanh(head.inner(torch.cat([hidden, memory], dim=-1))))  # [R, V]
        return q.gather(-1, ids.to(q.device, torch.long))

    def _memory(self, generated: Sequence[Sequence[int]]) -> torch.Tensor:
        """m_t-1 [R, M] of rows with t tokens: the read-out summed over the states before the
        last (s_0..s_t-1); zero at t = 0 (no forward)."""
        if not generated[0]:
            device = self.head.out.weight.device
            return torch.zeros(len(generated), self.head.read.out_features, device=device)
        parts = []
        for part in _chunks([list(g[:-1]) for g in generated], self.chunk):
            hidden, states = self._states(part)
            parts.append((self.head.read(hidden) * states[..., None]).sum(dim=1))  # [b, M]
        return torch.cat(parts)

    @torch.no_grad()
    def prefix_values(self, prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        """V(prompt + prefix) = Q(prompt + prefix[:-1], prefix[-1]) of each row ([B]); an
        empty prefix gets E_p[Q(prompt, .)], the expectation under the base policy."""
        q = self.q_values([p[:-1] for p in prefixes])  # [B, V]
        last = torch.tensor([p[-1] if len(p) else 0 for p in prefixes], dtype=torch.long)
        values = q.gather(-1, last[:, None].to(q.device))[:, 0]
        if any(len(p) == 0 for p in prefixes):
            probs = logprobs(self.model, torch.tensor([self.prompt_ids]))[0, -1].exp()  # p(. | prompt)
            empty = torch.tensor([len(p) == 0 for p in prefixes], device=q.device)
            values = torch.where(empty, q @ probs.to(q), values)
        return values


def _chunks(rows: Sequence, size: int) -> list[Sequence]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]
