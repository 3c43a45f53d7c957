"""NativeLM's batch-invariant mode: a seeded request's tokens and logprobs are bit-identical
alone and in any batch, and a sequence's logits are bit-identical however it is computed.

The model is the random tiny Llama of tests/conftest.py, whose near-uniform distributions
put many draws near a boundary: in the default mode its logprobs differ between these
runs by ~1e-6 (float rounding of batched matmuls), so exact equality catches any
arithmetic that depends on the batch.
"""

from __future__ import annotations

import engine_fixtures
import pytest
import torch

import decodekit as dk
from decodekit.engine.config import EngineConfig
from decodekit.engine.engine import Engine
from decodekit.models.base import left_pad
from decodekit.models.linear import rowwise_linear
from decodekit.models.native import NativeLM

one_thread = engine_fixtures.one_thread  # fixture

MINE = [5, 17, 3, 99, 42, 8, 8, 61, 2, 30]
OTHERS = [[7, 1, 88], [5, 17, 3, 99, 42, 8, 8, 61, 4], [64, 9, 0, 12, 77, 3, 50, 6, 6, 1, 2, 3, 4, 9]]
PARAMS = dk.SamplingParams(max_new_tokens=14, seed=3, n=2, top_k=40, temperature=1.2,
                           ignore_eos=True, logprobs=3)  # fmt: skip


@pytest.fixture(scope="module")
def invariant_lm(tiny_llama_dir) -> NativeLM:
    return NativeLM.from_pretrained(tiny_llama_dir, batch_invariant=True)


def outputs(completions) -> list[tuple]:
    """Everything a completion reports that depends on the logits, for exact comparison."""
    return [(c.token_ids, c.logprobs, c.processed_logprobs, c.top_logprobs) for c in completions]


def run(eng: Engine, *handles) -> None:
    while not all(h.done for h in handles):
        eng.step()


def alone(model) -> list[tuple]:
    eng = Engine(model, EngineConfig(block_size=4, num_blocks=64))
    handle = eng.submit(MINE, PARAMS)
    run(eng, handle)
    return outputs(handle.result(0))


def test_seeded_request_is_bit_identical_alone_and_in_mixed_batches(invariant_lm):
    want = alone(invariant_lm)
    others = [dk.SamplingParams(max_new_tokens=9, seed=1, n=3, temperature=0.8),
              dk.SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True),
              dk.SamplingParams(max_new_tokens=6, top_p=0.9, n=2)]  # fmt: skip
    # 1. submitted together, between requests of other lengths and n (decodekit.generate)
    got = dk.generate(invariant_lm, [OTHERS[0], MINE, OTHERS[2]], [others[0], PARAMS, others[2]])
    assert outputs(got[1]) == want
    # 2. joining a running batch after a prompt sharing its first two blocks (prefix cache)
    eng = Engine(invariant_lm, EngineConfig(block_size=4, num_blocks=64))
    early = [eng.submit(p, o) for p, o in zip(OTHERS[1:], others[1:])]
    for _ in range(3):
        eng.step()
    mine = eng.submit(MINE, PARAMS)
    run(eng, mine, *early)
    assert eng.stats()["prefix_cache_hit_tokens"] >= 8
    assert outputs(mine.result(0)) == want
    # 3. preempted and recomputed under a small memory bound
    eng = Engine(invariant_lm, EngineConfig(block_size=4, num_blocks=16))
    handles = [eng.submit(p, o) for p, o in zip(OTHERS[:2], others[:2])]
    mine = eng.submit(MINE, PARAMS)
    run(eng, mine, *handles)
    assert eng.stats()["preemptions"] > 0
    assert outputs(mine.result(0)) == want


def test_logits_are_bit_identical_however_the_sequence_is_batched(invariant_lm):
    model = invariant_lm
    tokens = MINE + [11, 23, 5, 8]
    full = model.forward(torch.tensor([tokens]), model.new_cache(1))[0]  # [T, V]
    cache = model.new_cache(1)
    steps = [model.forward(torch.tensor([tokens[:6]]), cache)[0]]
    steps += [model.forward(torch.tensor([[t]]), cache)[0] for t in tokens[6:]]
    assert torch.equal(torch.cat(steps), full)
    padded, mask = left_pad([OTHERS[2], tokens, OTHERS[0]])
    batched = model.forward(padded, model.new_cache(3), mask)[1, -len(tokens) :]
    assert torch.equal(batched, full)
    # the paged engine, beside other requests: its logprobs are log_softmax of `full`
    greedy = dk.SamplingParams(temperature=0, max_new_tokens=1, logprobs=5)
    got = dk.generate(model, [OTHERS[1], tokens, OTHERS[2]], greedy)[1][0]
    expected = torch.log_softmax(full[-1], dim=-1)
    assert got.top_logprobs[0] == {i: float(expected[i]) for i in got.top_logprobs[0]}


def test_rowwise_linear_gives_each_token_its_lone_product():
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40)
    wrapped = torch.nn.Sequential(linear)  # not an nn.Linear: called once per token
    x = torch.randn(3, 5, 24)  # [B, T, in]
    for layer in (linear, wrapped):
        out = rowwise_linear(layer, x)
        assert out.shape == (3, 5, 40)
        for b in range(3):
            for t in range(5):
                assert torch.equal(out[b, t], rowwise_linear(layer, x[b : b + 1, t : t + 1])[0, 0])
        assert torch.allclose(out, linear(x), atol=1e-5)
