"""The `Generator` protocol: what every meta-generator calls (ARCHITECTURE.md).

    generate(prompts, n, params) -> list[list[Completion]]   (n per prompt)
    score(prompt, continuations) -> list[float]              (log p(continuation | prompt))

`n` is one count for every prompt or a sequence of counts, one per prompt (tree search
gives each node its own number of children); `params` is one `SamplingParams` or one per
prompt (a meta-generator gives each request its own seed, so two identical prefixes in one
call do not draw identical samples). `params.n` is ignored: `n` says how many.

`LocalGenerator` runs a `LanguageModel` in this process: the n samples of a prompt share
its prefill (the prompt is computed once and its KV forked), and the samples that reused
it say so in `usage.cached_prompt_tokens`. A paged-KV model runs on its persistent engine
(engine/engine.py `engine_for`), whose prefix cache outlives a call: a prompt that extends an earlier
call's text (a tree-search child) computes only its new tokens, and its first sample's
`cached_prompt_tokens` counts the rest. A remote OpenAI-compatible
endpoint implements the same protocol (meta/remote.py), so meta-generators never know
which they call. Every call is counted in the generator's `Budget`; `call_generator`
copies what a call spent into a meta-generator's own budget.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from decodekit.completion import Completion
from decodekit.meta.budget import Budget
from decodekit.models.base import LanguageModel, score_tokens
from decodekit.params import SamplingParams
from decodekit.request import per_prompt_params
from decodekit.validate import check_n

PREFIX_MODES = ("shared", "replicated", "separate")


@runtime_checkable
class Generator(Protocol):
    budget: Budget

    def generate(
        self,
        prompts: Sequence[str],
        n: int | Sequence[int],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[list[Completion]]: ...

    def score(self, prompt: str, continuations: Sequence[str]) -> list[float]: ...


def per_prompt_counts(n: int | Sequence[int], count: int) -> list[int]:
    """`n` as one count per prompt; every count must be an integer >= 1."""
    counts = list(n) if isinstance(n, Sequence) else [n] * count
    if len(counts) != count:
        raise ValueError(f"n must be an integer or one count per prompt ({count}), got {len(counts)}")
    return [check_n(k) for k in counts]


def per_prompt(prompts: Sequence, n: int | Sequence[int], params: SamplingParams | Sequence[SamplingParams]
               ) -> tuple[list, list[int], list[SamplingParams]]:  # fmt: skip
    """A Generator's arguments checked and spread: (prompts, a count each, params each)."""
    prompts = list(prompts)
    return prompts, per_prompt_counts(n, len(prompts)), per_prompt_params(params, len(prompts))


def derive_seed(seed: int | None, *keys: int | str) -> int | None:
    """A reproducible seed for sub-request `keys` of a seeded run (None stays None)."""
    if seed is None:
        return None
    # random.Random seeds a string through SHA-512: stable across runs and platforms.
    return random.Random(":".join(map(str, (seed, *keys)))).getrandbits(62)


def account_request(budget: Budget, completions: Sequence[Completion]) -> None:
    """Count one request's completions from their usage: prompt tokens computed (those not
    marked `cached_prompt_tokens`), reused, and generated."""
    cached = sum(c.usage.cached_prompt_tokens for c in completions)
    prompt = sum(c.usage.prompt_tokens for c in completions) - cached
    budget.add_generation(prompt, sum(c.usage.completion_tokens for c in completions), reused=cached)


def call_generator(
    generator: Generator,
    prompts: Sequence[str],
    n: int | Sequence[int],
    params: SamplingParams | Sequence[SamplingParams],
    budget: Budget,
) -> list[list[Completion]]:
    """`generator.generate`, with what it spent also added to `budget` (once, if they are one)."""
    if budget is generator.budget:
        return generator.generate(prompts, n, params)
    before = generator.budget.counts()
    results = generator.generate(prompts, n, params)
    budget.add_counts(generator.budget.since(before))
    return results


class LocalGenerator:
    """A Generator over a local model. `budget` accumulates every call's tokens.

    prefix: "shared" (default) prefills each prompt once and forks its KV cache into the
    n samples; "replicated" batches n copies of the prompt (each prefilled: no sharing);
    "separate" makes one `generate` call per sample. The last two exist to measure what
    sharing saves; samples of a seeded request use seeds derived per copy, so they differ
    from the shared mode's draws but are equally distributed.
    """

    def __init__(self, model: LanguageModel, budget: Budget | None = None, prefix: str = "shared"):
        if prefix not in PREFIX_MODES:
            raise ValueError(f"prefix must be one of {PREFIX_MODES}, got {prefix!r}")
        self.model = model
        self.budget = budget if budget is not None else Budget()
        self.prefix = prefix

    def generate(
        self,
        prompts: Sequence[str],
        n: int | Sequence[int],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[list[Completion]]:
        from decodekit.decode.sample import generate

        prompts, counts, params_list = per_prompt(prompts, n, params)
        if self.prefix == "shared":
            requests = [p.replace(n=k) for p, k in zip(params_list, counts)]
            results = generate(self.model, prompts, requests)
            for completions in results:
                for completion in completions[1:]:  # forked from the first sample's prefill
                    completion.usage.cached_prompt_tokens = completion.usage.prompt_tokens
                account_request(self.budget, completions)
            return results
        copies = [(i, p.replace(n=1, seed=derive_seed(p.seed, "copy", j)))
                  for i, (p, k) in enumerate(zip(params_list, counts)) for j in range(k)]
        if self.prefix == "replicated":
            copied = [prompts[i] for i, _ in copies]
            flat = [c[0] for c in generate(self.model, copied, [p for _, p in copies])]
        else:
            flat = [generate(self.model, [prompts[i]], p)[0][0] for i, p in copies]
        results: list[list[Completion]] = [[] for _ in prompts]
        for (i, _), completion in zip(copies, flat):
            results[i].append(completion)
            account_request(self.budget, [completion])  # every copy is its own request
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
            if len(full) == len(prompt_ids):
                scores.append(0.0)
                continue
            scores.append(float(score_tokens(self.model, full, len(prompt_ids)).sum()))
            self.budget.add_generation(len(full) - 1, 0)
        return scores
