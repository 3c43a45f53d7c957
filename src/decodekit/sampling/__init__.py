"""Sampling adapters (logits -> logits), the per-request chain and state, and selectors."""

from decodekit.sampling import processors
from decodekit.sampling.chain import SamplerState, build_chain
from decodekit.sampling.select import draw, logprobs_of, sample_categorical, select_tokens, top_logprobs

__all__ = [
    "SamplerState",
    "build_chain",
    "draw",
    "logprobs_of",
    "processors",
    "sample_categorical",
    "select_tokens",
    "top_logprobs",
]
