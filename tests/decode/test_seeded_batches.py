"""The default mode's guarantee: a seeded request's random stream is its own.

Each request draws from its own generator, one uniform per row per step, so what else
shares the batch never moves its draws. Only the logits can differ with the batch (by
float rounding, ~1e-5, unless NativeLM's batch-invariant mode is on: tests/engine/
test_batch_invariant.py). So with a model whose forward is exactly the same in any
batch, a seeded request's whole output must be identical in any batch.
"""

from __future__ import annotations

import torch

import decodekit as dk
from decodekit.models.base import Cache, LanguageModel

VOCAB = 40


class LengthCache(Cache):
    def __init__(self, batch_size: int, length: int = 0):
        self.batch_size, self._length = batch_size, length

    @property
    def length(self) -> int:
        return self._length

    def fork(self, rows):
        return LengthCache(len(rows), self._length)

    def select(self, rows):
        self.batch_size = len(rows)

    def crop(self, length: int):
        self._length = length


class LastTokenLM(LanguageModel):
    """logits(next | ..., t) = table[t]: a lookup, exactly the same in any batch."""

    def __init__(self, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.table = 2.0 * torch.randn(VOCAB, VOCAB, generator=generator)  # [V, V]
        self.name, self.tokenizer, self.max_context = "last-token", None, 1000
        self.vocab_size, self.eos_token_ids = VOCAB, (0,)

    def new_cache(self, batch_size: int) -> LengthCache:
        return LengthCache(batch_size)

    def forward(self, tokens, cache, mask=None):
        cache._length += tokens.shape[1]
        return self.table[tokens]  # [B, T, V]


def outputs(completions) -> list[tuple]:
    return [(c.token_ids, c.logprobs, c.processed_logprobs, c.top_logprobs, c.finish_reason)
            for c in completions]  # fmt: skip


def test_seeded_output_is_identical_in_any_batch_when_the_logits_are():
    model = LastTokenLM()
    mine = dk.SamplingParams(max_new_tokens=12, seed=3, n=3, top_k=20, temperature=0.9,
                             logprobs=2, repetition_penalty=1.2)  # fmt: skip
    prompt = [5, 6, 7, 8]
    want = outputs(dk.generate(model, [prompt], mine)[0])
    assert len({tuple(t[0]) for t in want}) > 1  # the samples differ: draws matter
    # Unseeded, seeded, greedy and n > 1 neighbours of other lengths, finishing earlier
    # or later (their rows leave the batch at other steps).
    others = [dk.SamplingParams(max_new_tokens=5, n=4),
              dk.SamplingParams(max_new_tokens=20, seed=3, min_p=0.05),
              dk.SamplingParams(max_new_tokens=8, temperature=0)]  # fmt: skip
    arrangements = [
        ([[1, 2], prompt, [9] * 11], [others[0], mine, others[1]]),
        ([prompt, [3], [4, 4, 4], [30, 31]], [mine, others[2], others[0], others[1]]),
        ([[2] * 7, [8, 9], prompt], [others[1], others[1], mine]),
    ]
    for prompts, params in arrangements:
        got = dk.generate(model, prompts, params)
        assert outputs(got[prompts.index(prompt)]) == want
