"""What a primitive generator returns: one `Completion` per sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class Usage:
    """Token counts of one request. `cached_prompt_tokens` were reused, not recomputed."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Completion:
    """One generated continuation.

    `logprobs[i]` is log p(token_ids[i]) under the raw model (temperature 1, no
    adapters); `processed_logprobs[i]` is the same token under the distribution it
    was actually drawn from. `top_logprobs[i]` maps the k most likely raw tokens
    to their log-probabilities when `SamplingParams.logprobs = k`. With
    `SamplingParams.entropies`, `entropies[i]` is the raw distribution's entropy (nats) at
    token i and `final_logprobs` [V] the raw log-probs of the last step (the distribution the
    last token, an EOS say, was drawn from): a probe reward model of this model's confidence
    reads them instead of running the model again (meta/rewards.py).
    finish_reason: "stop" (EOS, stop token, stop string, or a completed
    constraint) or "length"; `stop_reason` says which string or token stopped it.
    """

    token_ids: list[int]
    text: str
    logprobs: list[float]
    processed_logprobs: list[float]
    finish_reason: str
    usage: Usage = field(default_factory=Usage)
    top_logprobs: list[dict[int, float]] | None = None
    stop_reason: str | int | None = None
    score: float | None = None
    entropies: list[float] | None = None
    final_logprobs: torch.Tensor | None = None  # [V]

    @property
    def cumulative_logprob(self) -> float:
        return float(sum(self.logprobs))
