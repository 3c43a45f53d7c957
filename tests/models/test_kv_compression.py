"""Token dropping (StreamingLLM's sinks + recent window, issue 17 item 4): the sinks are
always kept, a query keeps exactly its budget, a budget of the whole sequence is the full
cache exactly, and scoring a sequence in one forward equals decoding it token by token."""

from __future__ import annotations

import pytest
import torch

from decodekit.bench.kv_compression import CompressedCacheLM
from decodekit.models.attention import prefill_attention as attend
from decodekit.models.contiguous_kv import (
    CompressedKVCache,
    causal_mask,
    heavy_hitter_attention,
    streaming_mask,
)
from decodekit.models.native import NativeLM

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir) -> NativeLM:
    return NativeLM.from_pretrained(tiny_llama_dir)


@pytest.mark.parametrize("start, num_new", [(0, 20), (13, 1), (7, 6)])
def test_streaming_mask_keeps_sinks_and_the_recent_window(start, num_new):
    sinks, recent = 3, 5
    mask = streaming_mask(start, num_new, sinks, recent)  # [T, start + T]
    assert mask.shape == (num_new, start + num_new)
    for t in range(num_new):
        position = start + t
        seen = mask[t].nonzero()[:, 0].tolist()
        assert seen == sorted(set(range(min(sinks, position + 1))) |
                              set(range(max(0, position - recent + 1), position + 1)))  # fmt: skip
        assert len(seen) == min(position + 1, sinks + recent)  # the budget, once it is reached
        assert position in seen and all(s <= position for s in seen)


def _logits(model, tokens, budget, sinks=2, step=False, kv_dtype=None):
    c = model.config
    cache = CompressedKVCache(c.num_layers, len(tokens), c.num_kv_heads, c.head_dim, kv_dtype=kv_dtype,
                              budget=budget, sinks=sinks)  # fmt: skip
    if not step:
        return model.forward(tokens, cache)  # [B, T, V]
    return torch.cat([model.forward(tokens[:, t : t + 1], cache) for t in range(tokens.shape[1])], dim=1)


def test_whole_budget_is_the_full_cache_exactly(tiny):
    tokens = torch.randint(0, tiny.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    full = tiny.forward(tokens, tiny.new_cache(2))
    assert torch.equal(_logits(tiny, tokens, budget=24), full)
    assert torch.equal(_logits(tiny, tokens, budget=None), full)
    assert torch.equal(_logits(tiny, tokens, budget=None, kv_dtype=torch.float32), full)


def test_dropping_changes_only_positions_past_the_budget(tiny):
    tokens = torch.randint(0, tiny.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    full = tiny.forward(tokens, tiny.new_cache(2))
    dropped = _logits(tiny, tokens, budget=8)
    assert torch.allclose(dropped[:, :8], full[:, :8], atol=1e-5)
    assert float((dropped[:, 8:] - full[:, 8:]).abs().amax(-1).min()) > 1e-4  # every later query changed
    # one forward and a token-by-token decode evict the same keys
    assert torch.allclose(_logits(tiny, tokens, budget=8, step=True), dropped, atol=1e-5)


def test_sinks_matter_and_budget_is_checked(tiny):
    tokens = torch.randint(0, tiny.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))
    assert not torch.allclose(_logits(tiny, tokens, budget=8, sinks=0), _logits(tiny, tokens, budget=8))
    with pytest.raises(ValueError, match="budget must be at least sinks \\+ 1 = 5, got 4"):
        _logits(tiny, tokens, budget=4, sinks=4)


def test_int8_cache_scores_close_to_float32(tiny):
    tokens = torch.randint(0, tiny.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    full = torch.log_softmax(tiny.forward(tokens, tiny.new_cache(1)), -1)
    int8 = torch.log_softmax(_logits(tiny, tokens, budget=None, kv_dtype=torch.int8), -1)
    assert 0 < float((int8 - full).abs().max()) < 0.05
    wrapped = CompressedCacheLM(tiny, kv_dtype=torch.int8)
    expected = _logits(tiny, tokens, None, kv_dtype=torch.int8)
    assert torch.equal(wrapped.forward(tokens, wrapped.new_cache(1)), expected)


def test_heavy_hitters_without_heavy_budget_is_the_recent_window():
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 12, 8, generator=generator)
    k, v = torch.randn(2, 2, 2, 12, 8, generator=generator)
    window = attend(q, k, v, causal_mask(0, 12, window=5)[None, None], causal=False)
    assert torch.allclose(heavy_hitter_attention(q, k, v, budget=5, recent=5), window, atol=1e-5)
    full = attend(q, k, v, None, causal=True)
    assert torch.allclose(heavy_hitter_attention(q, k, v, budget=12, recent=6), full, atol=1e-5)
    dropped = heavy_hitter_attention(q, k, v, budget=6, recent=3)
    assert torch.allclose(dropped[:, :, :6], full[:, :, :6], atol=1e-5)  # within the budget
    assert not torch.allclose(dropped, full, atol=1e-3)
    assert not torch.allclose(dropped, heavy_hitter_attention(q, k, v, budget=6, recent=6), atol=1e-3)


def test_h2o_cache_at_whole_budget_is_the_full_cache(tiny):
    tokens = torch.randint(0, tiny.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    c = tiny.config
    full = tiny.forward(tokens, tiny.new_cache(2))

    def h2o(budget):
        cache = CompressedKVCache(c.num_layers, 2, c.num_kv_heads, c.head_dim, budget=budget, policy="h2o")
        return tiny.forward(tokens, cache)

    assert torch.equal(h2o(16), full)  # never over budget: the plain path
    over = h2o(15)  # over budget at the last query only
    assert torch.allclose(over[:, :15], full[:, :15], atol=1e-4)
    assert not torch.allclose(over[:, 15], full[:, 15], atol=1e-4)
    assert not torch.allclose(h2o(6), full, atol=1e-3)
    with pytest.raises(ValueError, match="policy must be one of streaming, h2o, got 'lru'"):
        CompressedKVCache(1, 1, 1, 8, policy="lru")
