"""Blockwise controlled decoding (Mudgal et al. 2024; seed 000, "best-of-n++"): best-of-K
over blocks of M tokens, repeated until the completion is long enough.

`BlockwiseCD(generator, value, k, m)` is itself a `Generator` (meta/generator.py), so any
meta-generator can run on top of it. For each of the n samples of a prompt it asks the
inner generator for K continuations of at most M tokens (`max_new_tokens = M`), keeps the
one whose completion so far has the highest value V (the first among ties), appends it to
the sample's prompt and goes on until `params.max_new_tokens` tokens are out.
KL(pi || p) <= (L/M)(log K - (K-1)/K) (`align.bon.blockwise_kl_bound`).

- One inner call per round covers every live sample (K each), so a local model batches
  them; on the paged engine a sample's next block finds the kept block's KV in the
  prefix cache.
- SamplingParams go to the inner calls (temperature, top-p, penalties, stop, EOS, logprobs);
  `max_new_tokens` and `min_new_tokens` count the whole completion; `params.n` is ignored
  (the `n` argument says how many, as for every Generator). A kept block that stops (EOS,
  a stop token or string) or that the context window cut short ends its sample with that
  finish reason; so does a stop string that straddles two blocks (the text is cut before
  it, the tokens keep the whole block).
- Seeds: sample j's block b draws with `derive_seed(params.seed, "block", j, b)`, so a
  seeded call is reproducible and its samples differ; None stays unseeded.
- A prompt of token ids grows by the kept block's token ids (exact; a local generator), a
  text prompt by its text (any generator; the model re-tokenises the joined text). The
  completion's text is the blocks' texts joined.
- `value` maps the candidates' token ids (the completion so far, prompt excluded) to their
  values: `PrefixValue.prefix_values` (align/value.py), or any callable of that shape (a
  remote generator needs `return_token_ids=True`).
- `budget` counts what the inner calls spent and one scorer call per candidate scored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from decodekit.completion import Completion, Usage
from decodekit.meta.budget import Budget
from decodekit.meta.generator import Generator, call_generator, derive_seed, per_prompt
from decodekit.params import SamplingParams
from decodekit.request import Prompt
from decodekit.validate import check_n

__all__ = ["BlockValue", "BlockwiseCD"]

# The values [B] of candidate completions given as token ids (prompt excluded).
BlockValue = Callable[[Sequence[Sequence[int]]], Sequence[float] | torch.Tensor]


@dataclass
class _Sample:
    """One sample being built: its prompt so far and the blocks it kept."""

    index: int  # j: the sample's index among its prompt's n
    prompt: Prompt
    params: SamplingParams
    blocks: list[Completion] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def block_params(self, m: int, k: int, block: int) -> SamplingParams:
        p = self.params
        width = min(m, p.max_new_tokens - len(self.tokens))
        return p.replace(n=k, max_new_tokens=width, seed=derive_seed(p.seed, "block", self.index, block),
                         min_new_tokens=min(width, max(0, p.min_new_tokens - len(self.tokens))))

    def keep(self, block: Completion, width: int) -> None:
        """Append the chosen block; end the sample if it stopped, was cut short or is long enough."""
        boundary = len(self.text)
        self.blocks.append(block)
        self.tokens += block.token_ids
        self.text += block.text
        self.prompt = (self.prompt + block.text if isinstance(self.prompt, str)
                       else [*self.prompt, *block.token_ids])
        stops = [(i, s) for s in self.params.stop
                 if (i := self.text.find(s, max(0, boundary - len(s) + 1))) >= 0]
        if stops:  # a stop string across the boundary of two blocks (before any in the block)
            cut, self.stop_reason = min(stops)
            self.text, self.finish_reason = self.text[:cut], "stop"
        elif block.finish_reason == "stop":
            self.finish_reason, self.stop_reason = "stop", block.stop_reason
        elif len(block.token_ids) < width or len(self.tokens) >= self.params.max_new_tokens:
            self.finish_reason = "length"

    def completion(self) -> Completion:
        first = self.blocks[0]
        tops = [b.top_logprobs for b in self.blocks]
        return Completion(
            token_ids=list(self.tokens),
            text=self.text,
            logprobs=[x for b in self.blocks for x in b.logprobs],
            processed_logprobs=[x for b in self.blocks for x in b.processed_logprobs],
            finish_reason=self.finish_reason or "length",
            usage=Usage(first.usage.prompt_tokens, len(self.tokens), first.usage.cached_prompt_tokens),
            top_logprobs=None if None in tops else [x for t in tops for x in t],
            stop_reason=self.stop_reason,
        )


class BlockwiseCD:
    """A Generator: best-of-`k` blocks of `m` tokens from `generator`, chosen by `value`."""

    def __init__(self, generator: Generator, value: BlockValue, k: int, m: int, budget: Budget | None = None):
        check_n(k, "k")
        check_n(m, "m")
        if not callable(value):
            raise TypeError(f"value must be a callable from token-id lists to values, got {value!r:.80}")
        self.generator, self.value, self.k, self.m = generator, value, k, m
        self.budget = budget if budget is not None else Budget()

    def generate(
        self,
        prompts: Sequence[Prompt],
        n: int | Sequence[int],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[list[Completion]]:
        prompts, counts, params_list = per_prompt(prompts, n, params)
        samples = [[_Sample(j, prompt, p) for j in range(count)]
                   for prompt, p, count in zip(prompts, params_list, counts)]
        live = [s for group in samples for s in group]
        block = 0
        while live:
            asks = [s.block_params(self.m, self.k, block) for s in live]
            results = call_generator(self.generator, [s.prompt for s in live], self.k, asks, self.budget)
            candidates = [s.tokens + c.token_ids for s, found in zip(live, results) for c in found]
            with torch.no_grad():
                values = [float(v) for v in self.value(candidates)]
            if len(values) != len(candidates):
                raise ValueError(f"value returned {len(values)} values for {len(candidates)} candidates")
            self.budget.add_scorer_calls(len(candidates))
            start = 0
            for s, found, ask in zip(live, results, asks):
                scores = values[start : start + len(found)]
                start += len(found)
                s.keep(found[max(range(len(found)), key=scores.__getitem__)], ask.max_new_tokens)
            live = [s for s in live if s.finish_reason is None]
            block += 1
        return [[s.completion() for s in group] for group in samples]

    def score(self, prompt: str, continuations: Sequence[str]) -> list[float]:
        raise ValueError("blockwise controlled decoding has no tractable log-probability; "
                         "score with its inner generator")
