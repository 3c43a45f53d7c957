"""Held-out perplexity of any `LanguageModel`, per token, in sliding windows.

A text longer than the model's context is scored in windows of `window` tokens that start
every `stride` tokens (the "strided" evaluation of the Hugging Face perplexity guide, and
GPTQ's and SparseGPT's WikiText-2 numbers use fixed windows the same way). Each token is
scored exactly once, by the first window that holds it with at least one token before it;
with stride < window every token after the first window sees at least window - stride
tokens of context. Perplexity = exp(mean negative log-likelihood in nats) over the N - 1
scored tokens (the first token of the text has no context and is not scored).

`mean_kl` compares a model with a reference (a compressed model with its float original)
position by position over the whole next-token distribution: on a small model, perplexity
on a fixed text moves by less than the distributions do, and can move either way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import torch

from decodekit.models.base import LanguageModel, logprobs, score_batch
from decodekit.models.registry import ASSETS
from decodekit.runtime import progress as progress_bar

TEST_TEXT = ASSETS / "data" / "shakespeare_test.txt"
# The held-out plays shipped with the package (MODELS.md): the one perplexity protocol of
# MODELS.md, registry.json and `decodekit models` is `text_perplexity` with its defaults on
# one of these, which is what `decodekit eval perplexity MODEL [--split val]` runs.
HELD_OUT = {"test": TEST_TEXT, "val": ASSETS / "data" / "shakespeare_val.txt"}
EOS_MARKER = "<|endoftext|>"
# Tokens per batch of windows: two of the shipped models' 512-token windows. Larger batches
# bought no speed on CPU (the shipped model, one thread, AMD EPYC Zen 3: 8 windows cost
# 1.05-1.11 s of CPU one a batch, 1.02-1.22 s two, 1.39-1.42 s eight; the scores are the
# same to the bit) and held the progress bar still: the test split's 37 batches of eight
# took 9 min 41 s on a loaded machine, about 16 s a batch (issue 35).
BATCH_TOKENS = 1024
# Default window: the model's context, at most this (GPTQ and SparseGPT score WikiText-2
# in 2048-token windows; a k-gram model's context is unbounded).
MAX_DEFAULT_WINDOW = 2048


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood, nats per token
    tokens: int  # tokens scored
    window: int
    stride: int
    characters: int | None = None  # characters of the text, when scored from text

    @property
    def bits_per_char(self) -> float | None:
        """Total negative log-likelihood in bits over the text's characters."""
        if not self.characters:
            return None
        return self.nll * self.tokens / math.log(2) / self.characters

    def to_dict(self) -> dict:
        return asdict(self) | {"bits_per_char": self.bits_per_char}


def windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window over a stream of `num_tokens`.

    Position j is scored by the window [begin, end) with begin < j < end that comes first;
    together the windows score positions 1 .. num_tokens - 1 once each.
    """
    if window < 2:
        raise ValueError(f"window must be >= 2, got {window}")
    if not 1 <= stride <= window - 1:
        raise ValueError(f"stride must be in [1, window - 1] = [1, {window - 1}], got {stride}")
    out, scored_to = [], 1
    for begin in range(0, max(num_tokens - 1, 1), stride):
        end = min(begin + window, num_tokens)
        if end > scored_to:
            out.append((begin, end, scored_to))
            scored_to = end
        if end == num_tokens:
            break
    return out


@torch.inference_mode()
def perplexity(
    model: LanguageModel,
    tokens: Sequence[int] | torch.Tensor,
    window: int | None = None,
    stride: int | None = None,
    batch_tokens: int = BATCH_TOKENS,
    progress: bool = False,
) -> PerplexityResult:
    """Per-token perplexity of a token stream [N]; window defaults to the model's context (at
    most MAX_DEFAULT_WINDOW) and stride to half the window (module docstring). Windows run
    in batches of about `batch_tokens` tokens, which bounds the memory of the logits.
    `progress`: a bar over the windows on stderr, advanced after every batch."""
    ids = torch.as_tensor(tokens, dtype=torch.long).flatten()  # [N]
    if len(ids) < 2:
        raise ValueError(f"need at least 2 tokens to score, got {len(ids)}")
    window = window or min(model.max_context, MAX_DEFAULT_WINDOW)
    if window > model.max_context:
        raise ValueError(f"window must be at most the model's context {model.max_context}, got {window}")
    window = min(window, len(ids))
    stride = stride or max(1, window // 2)
    spans = windows(len(ids), window, stride)
    # Windows of equal length run together, each row with a fresh cache.
    by_length: dict[int, list[tuple[int, int, int]]] = {}
    for span in spans:
        by_length.setdefault(span[1] - span[0], []).append(span)
    total, count = 0.0, 0
    with progress_bar(total=len(spans), desc="perplexity", enabled=progress) as bar:
        for length, group in by_length.items():
            batch_size = max(1, batch_tokens // length)
            for i in range(0, len(group), batch_size):
                chunk = group[i : i + batch_size]
                rows = torch.stack([ids[b:e] for b, e, _ in chunk])  # [B, length]
                for scores in score_batch(model, rows, [first - begin for begin, _, first in chunk]):
                    total -= float(scores.sum())  # scores: [end - first]
                    count += len(scores)
                bar.update(len(chunk))
    nll = total / count
    return PerplexityResult(math.exp(nll), nll, count, window, stride)


def text_perplexity(
    model: LanguageModel,
    text: str | None = None,
    window: int | None = None,
    stride: int | None = None,
    batch_tokens: int = BATCH_TOKENS,
    split: str = "test",
    progress: bool = False,
) -> PerplexityResult:
    """`perplexity` of `text` tokenised by the model's own tokenizer; without a text, of the
    shipped held-out Shakespeare `split` ("test" or "val"). Characters exclude EOS markers.
    `progress`: perplexity's bar over the windows."""
    if text is None:
        if split not in HELD_OUT:
            raise ValueError(f"split must be one of {sorted(HELD_OUT)}, got {split!r}")
        text = HELD_OUT[split].read_text()
    result = perplexity(model, model.encode(text), window, stride, batch_tokens, progress)
    return replace(result, characters=len(text.replace(EOS_MARKER, "")))


@torch.inference_mode()
def window_logprobs(model: LanguageModel, tokens: torch.Tensor, rows_per_batch: int = 4) -> torch.Tensor:
    """Log-probabilities [W, T, V] of the model at every position of windows tokens [W, T]."""
    return torch.cat([logprobs(model, chunk) for chunk in tokens.split(rows_per_batch)])


@torch.inference_mode()
def mean_kl(
    reference_logprobs: torch.Tensor, model: LanguageModel, tokens: torch.Tensor, rows_per_batch: int = 4
) -> float:
    """Mean KL(p_ref ‖ p_model) in nats per position over windows tokens [W, T], given the
    reference model's `window_logprobs` [W, T, V]: how far compression moved the whole
    next-token distribution, not only the probability of the observed token."""
    total = 0.0
    for ref, chunk in zip(reference_logprobs.split(rows_per_batch), tokens.split(rows_per_batch)):
        logp = logprobs(model, chunk)  # [B, T, V]
        total += float((ref.exp() * (ref - logp)).sum())
    return total / tokens.numel()
