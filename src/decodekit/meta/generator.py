"""The `Generator` protocol: what every meta-generator calls (ARCHITECTURE.md).

    generate(prompts, n, params) -> list[list[Completion]]   (n per prompt)
    score(prompt, continuations) -> list[float]              (log p(continuation | prompt))

`LocalGenerator` runs a `LanguageModel` in this process: the n samples of a prompt
share its prefill (the prompt is computed once and its KV forked). A remote
OpenAI-compatible endpoint implements the same protocol (meta/remote.py), so
meta-generators never know which they call. Every call is counted in a `Budget`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from decodekit.completion import Completion
from decodekit.meta.budget import Budget
from decodekit.models.base import LanguageModel
from decodekit.params import SamplingParams


@runtime_checkable
class Generator(Protocol):
    budget: Budget

    def generate(
        self, prompts: Sequence[str], n: int, params: SamplingParams
    ) -> list[list[Completion]]: ...

    def score(self, prompt: str, continuations: Sequence[str]) -> list[float]: ...


class LocalGenerator:
    """A Generator over a local model. `budget` accumulates every call's tokens."""

    def __init__(self, model: LanguageModel, budget: Budget | None = None):
        self.model = model
        self.budget = budget or Budget()

    def generate(self, prompts: Sequence[str], n: int, params: SamplingParams) -> list[list[Completion]]:
        from decodekit.decode.sample import generate

        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        results = generate(self.model, list(prompts), params.replace(n=n))
        for completions in results:
            prompt_tokens = completions[0].usage.prompt_tokens
            generated = sum(c.usage.completion_tokens for c in completions)
            # The prompt is prefilled once; the other n - 1 samples reuse its KV.
            self.budget.add_generation(prompt_tokens, generated, reused=prompt_tokens * (n - 1))
        return results

    @torch.inference_mode()
    def score(self, prompt: str, continuations: Sequence[str]) -> list[float]:
        """Total log-probability of each continuation after the prompt (raw model, no adapters)."""
        prompt_ids = self.model.encode(prompt)
        scores = []
        for text in continuations:
            full = self.model.encode(prompt + text)
            if full[: len(prompt_ids)] != prompt_ids:
                raise ValueError("the continuation changes the prompt's tokenisation at the boundary")
            continuation = torch.tensor(full[len(prompt_ids) :])
            if len(continuation) == 0:
                scores.append(0.0)
                continue
            tokens = torch.tensor([full[:-1]])  # position i predicts token i + 1
            logits = self.model.forward(tokens, self.model.new_cache(1))[0, len(prompt_ids) - 1 :]
            logp = torch.log_softmax(logits, dim=-1)  # [len(continuation), V]
            scores.append(float(logp[torch.arange(len(continuation)), continuation].sum()))
            self.budget.add_generation(len(full) - 1, 0)
        return scores
