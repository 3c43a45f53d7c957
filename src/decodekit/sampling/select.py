"""Selectors: turn processed logits into token ids, and logprob helpers."""

from __future__ import annotations

import torch

from decodekit.sampling.chain import SamplerState


def select_tokens(processed_logits: torch.Tensor, state: SamplerState) -> torch.Tensor:
    """Tokens [R] long from processed logits [R, V]: argmax when the request is greedy
    (temperature 0), else one categorical draw per row from the request's generator."""
    if state.params.greedy:
        return processed_logits.argmax(dim=-1)
    return sample_categorical(processed_logits, state.generator)


def sample_categorical(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of softmax(logits) [R, V]: tokens [R] long (see `draw`)."""
    return draw(torch.softmax(logits.double(), dim=-1), generator)


def draw_rows(probs: torch.Tensor, generators: list[tuple[torch.Generator, int]]) -> torch.Tensor:
    """`draw` for the rows of several requests at once, probs [R, V]: each request's
    (generator, rows) in order draws its uniforms as `draw` would, so every row's token is
    the one it gets alone."""
    u = torch.cat([torch.rand(n, generator=g, dtype=torch.float64, device="cpu") for g, n in generators])
    return _invert(probs, u)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of probabilities probs [..., V] (weights need not sum to 1) by
    inverting the CDF at a uniform: long [...] (a 0-d tensor for probs [V]).

    Each row uses exactly one float64 uniform from the (CPU) generator, whatever V and the
    device of `probs`, so a seed gives the same draws on every device (None: torch's global
    generator). An index of zero probability is never drawn: the search returns the first i
    with cdf[i] > u * total.
    """
    u = torch.rand(probs.shape[:-1], generator=generator, dtype=torch.float64, device="cpu")  # [...], [0, 1)
    return _invert(probs, u)


def _invert(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first index i of each row of probs [..., V] with cdf[i] > u * total, u [...]."""
    cdf = torch.cumsum(probs.double(), dim=-1)  # [..., V]
    # to a GPU asynchronously, from pinned memory: no synchronisation of the host
    u = u.pin_memory().to(cdf.device, non_blocking=True) if cdf.is_cuda else u.to(cdf.device)
    target = u[..., None] * cdf[..., -1:]
    tokens = torch.searchsorted(cdf, target, right=True)[..., 0]
    return tokens.clamp(max=probs.shape[-1] - 1)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[r, tokens[r]] for logits [R, V] and tokens [R]: [R] float32."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(-1, tokens.to(log_probs.device).long()[:, None])[:, 0]


def top_logprobs(logits: torch.Tensor, k: int) -> list[dict[int, float]]:
    """The k most likely tokens of each row of logits [R, V] with their log-probabilities."""
    if k <= 0:
        return [{} for _ in range(logits.shape[0])]
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(min(k, logits.shape[-1]))
    return [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
