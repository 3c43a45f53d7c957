import math

import pytest
import torch

from decodekit.compress.evaluate import mean_kl, perplexity, text_perplexity, window_logprobs, windows
from decodekit.models.base import Cache, LanguageModel


class NullCache(Cache):
    def __init__(self) -> None:
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def fork(self, rows):
        return NullCache()

    def select(self, rows) -> None:
        pass

    def crop(self, length: int) -> None:
        self._length = length


class FixedLM(LanguageModel):
    """Every position predicts the same distribution softmax(logits), context ignored."""

    def __init__(self, logits: list[float], max_context: int) -> None:
        self.logits = torch.tensor(logits)
        self.vocab_size = len(logits)
        self.max_context = max_context
        self.name, self.eos_token_ids, self.tokenizer = "fixed", (), None

    def new_cache(self, batch_size: int) -> Cache:
        return NullCache()

    def forward(self, tokens, cache, mask=None):
        assert tokens.shape[1] <= self.max_context
        return self.logits.expand(*tokens.shape, self.vocab_size).clone()  # [B, T, V]


def test_windows_score_every_token_after_the_first_once():
    assert windows(10, 4, 2) == [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    assert windows(5, 8, 4) == [(0, 5, 1)]
    assert windows(7, 4, 3) == [(0, 4, 1), (3, 7, 4)]
    for n, w, s in [(37, 8, 3), (100, 16, 15), (2, 2, 1), (64, 16, 1)]:
        scored = [j for _, end, first in windows(n, w, s) for j in range(first, end)]
        assert scored == list(range(1, n))


@pytest.mark.parametrize(("window", "stride"), [(1, 1), (4, 0), (4, 4), (4, 5)])
def test_windows_reject_bad_sizes(window, stride):
    with pytest.raises(ValueError, match="window must be|stride must be"):
        windows(10, window, stride)


def test_perplexity_of_a_fixed_distribution_by_hand():
    # p = (1/4, 3/4); tokens 0 1 1 0 1: positions 1..4 are scored, tokens 1 1 0 1.
    model = FixedLM([math.log(1.0), math.log(3.0)], max_context=3)
    result = perplexity(model, [0, 1, 1, 0, 1])
    nll = -(3 * math.log(0.75) + math.log(0.25)) / 4
    assert result.tokens == 4 and (result.window, result.stride) == (3, 1)
    assert result.nll == pytest.approx(nll, abs=1e-6)
    assert result.perplexity == pytest.approx(math.exp(nll), rel=1e-6)


def test_uniform_model_has_perplexity_of_its_vocabulary():
    model = FixedLM([0.0] * 7, max_context=16)
    result = perplexity(model, torch.arange(50) % 7, window=8, stride=3, batch_tokens=16)
    assert result.tokens == 49
    assert result.perplexity == pytest.approx(7.0, rel=1e-6)


def test_strided_perplexity_equals_hand_windows_on_a_native_model(tiny_lm):
    ids = torch.tensor(tiny_lm.encode("ROMEO: But soft, what light through yonder window breaks? " * 3))
    n = len(ids)
    assert n > 40
    ids = ids[:40]
    result = perplexity(tiny_lm, ids, window=16, stride=8, batch_tokens=48)
    # The windows by hand: (begin, end, first scored position); each one run alone.
    total = 0.0
    for begin, end, first in [(0, 16, 1), (8, 24, 16), (16, 32, 24), (24, 40, 32)]:
        logits = tiny_lm.forward(ids[None, begin:end], tiny_lm.new_cache(1))[0]  # [T, V]
        logp = torch.log_softmax(logits, dim=-1)
        for j in range(first, end):
            total -= float(logp[j - begin - 1, ids[j]])
    assert result.tokens == 39
    assert result.nll == pytest.approx(total / 39, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(total / 39), rel=1e-5)


def test_progress_moves_after_every_batch_of_windows(tiny_lm, monkeypatch):
    """Issue 35: `eval perplexity` printed nothing for 9 min 41 s; the bar now moves with
    every batch of windows, and the score is the same with it or without it."""
    from decodekit.compress import evaluate

    positions = []

    class Recorder:
        n = 0

        def __init__(self, total, desc, enabled):
            assert (total, enabled) == (4, True)

        def update(self, n=1):
            self.n += n
            positions.append(self.n)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    ids = torch.tensor(tiny_lm.encode("ROMEO: But soft, what light through yonder window breaks? " * 3))[:40]
    plain = perplexity(tiny_lm, ids, window=16, stride=8, batch_tokens=32)
    monkeypatch.setattr(evaluate, "progress_bar", Recorder)
    shown = perplexity(tiny_lm, ids, window=16, stride=8, batch_tokens=32, progress=True)
    assert positions == [2, 4]  # 4 windows of 16 tokens, 2 a batch
    assert shown == plain


def test_text_perplexity_defaults_to_the_models_context(tiny_lm):
    text = "JULIET: O Romeo, Romeo, wherefore art thou Romeo? " * 8
    result = text_perplexity(tiny_lm, text)
    assert result.window == min(tiny_lm.max_context, len(tiny_lm.encode(text)))
    assert result.stride == result.window // 2
    assert result.tokens == len(tiny_lm.encode(text)) - 1
    with pytest.raises(ValueError, match="window must be at most the model's context 96"):
        text_perplexity(tiny_lm, text, window=200)


def test_mean_kl_of_two_fixed_distributions_by_hand():
    reference = FixedLM([math.log(1.0), math.log(3.0)], max_context=8)  # (1/4, 3/4)
    model = FixedLM([0.0, 0.0], max_context=8)  # (1/2, 1/2)
    tokens = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 1]])  # [W, T]
    ref_logprobs = window_logprobs(reference, tokens, rows_per_batch=2)
    assert ref_logprobs.shape == (3, 4, 2)
    expected = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert mean_kl(ref_logprobs, model, tokens, rows_per_batch=2) == pytest.approx(expected, rel=1e-6)
    assert mean_kl(ref_logprobs, reference, tokens) == pytest.approx(0.0, abs=1e-7)
