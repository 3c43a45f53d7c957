"""The block pool in bfloat16 and int8 (EngineConfig(kv_dtype=...), issue 17 item 4): the int8
round trip stays within half a quantisation step, what is written is what is read back
(after growth and copy-on-write copies too), the pool shrinks as the formula says, and
greedy decoding on the engine keeps the float32 pool's tokens."""

from __future__ import annotations

import engine_fixtures
import pytest
import torch

import decodekit as dk
from decodekit.engine.block_pool import BlockPool, block_bytes
from decodekit.engine.config import EngineConfig
from decodekit.engine.engine import Engine
from decodekit.models.base import logprobs
from decodekit.models.contiguous_kv import dequantize_int8, quantize_int8, round_trip

one_thread, sharp_lm = engine_fixtures.one_thread, engine_fixtures.sharp_lm  # fixtures


def test_int8_round_trip_within_half_a_step():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=generator) * torch.tensor([0.01, 1.0, 300.0])[:, None, None]
    x[0, 0] = 0  # an all-zero vector
    codes, scale = quantize_int8(x)
    assert codes.dtype == torch.int8 and scale.shape == x.shape[:-1]
    assert int(codes.abs().max()) == 127  # the absmax maps to 127
    back = dequantize_int8(codes, scale, torch.float32)
    assert bool(((back - x).abs() <= scale[..., None] / 2 + 1e-6 * x.abs()).all())
    assert bool((back[0, 0] == 0).all())
    # relative to each vector's largest value: at most 1/254
    assert float(((back - x).abs().amax(-1) / x.abs().amax(-1).clamp(min=1e-12)).max()) <= 1 / 254 + 1e-6
    assert torch.equal(round_trip(x, torch.float32), x)
    assert torch.equal(round_trip(x, torch.bfloat16), x.to(torch.bfloat16).float())


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
def test_pool_reads_back_what_write_returned(kv_dtype):
    layers, kv_heads, dim, size = 2, 2, 8, 4
    pool = BlockPool(layers, 200, size, kv_heads, dim, torch.float32, kv_dtype=kv_dtype)
    generator = torch.Generator().manual_seed(1)
    blocks = torch.tensor([3, 150, 70])  # 150 > the initial 64: the storage grows
    for block in blocks.tolist():
        pool._reserve(block + 1)
    slots = (blocks[:, None] * size + torch.arange(size)).flatten()  # every position of 3 blocks
    written = []
    for layer in range(layers):
        k, v = torch.randn(2, kv_heads, len(slots), dim, generator=generator)
        stored_k, stored_v = pool.write(layer, slots, k, v)
        assert stored_k.dtype == torch.float32
        assert float((stored_k - k).abs().max()) <= float(k.abs().max()) / 100
        written.append((stored_k, stored_v))
    for layer, (k, v) in enumerate(written):
        assert [torch.equal(a, b) for a, b in zip(pool.read(blocks, layer), (k, v))] == [True, True]
    every_k, _ = pool.read(blocks)  # [N, H_kv, 12, D]
    assert torch.equal(every_k[1], written[1][0])
    pool.copy(150, 5)
    assert torch.equal(pool.read(torch.tensor([5]), 0)[0], written[0][0][:, size : 2 * size])


def test_pool_bytes_follow_the_stored_dtype():
    shape = dict(num_layers=3, block_size=16, num_kv_heads=2, head_dim=64)
    f32 = block_bytes(**shape, kv_dtype=torch.float32)
    assert f32 == 2 * 3 * 16 * 2 * 64 * 4  # seed 001's formula for one block
    assert block_bytes(**shape, kv_dtype=torch.bfloat16) * 2 == f32
    assert block_bytes(**shape, kv_dtype=torch.int8) == f32 // 4 + 2 * 3 * 16 * 2 * 4  # + scales
    pool = BlockPool(3, 8, 16, 2, 64, torch.float32, kv_dtype=torch.int8)
    assert pool.bytes_per_block == block_bytes(**shape, kv_dtype=torch.int8)


def test_kv_dtype_is_checked():
    with pytest.raises(ValueError, match="kv_dtype must be one of .*got 'int4'"):
        EngineConfig(kv_dtype="int4")


def _greedy(model, prompts, kv_dtype, n=1):
    engine = Engine(model, EngineConfig(kv_dtype=kv_dtype, block_size=4))
    params = dk.SamplingParams(max_new_tokens=12, temperature=0.0, n=n, ignore_eos=True)
    handles = [engine.submit(prompt, params) for prompt in prompts]
    while not all(h.done for h in handles):
        engine.step()
    return [[c.token_ids for c in h.result(0)] for h in handles], engine.stats()["block_bytes"]


def _margin(model, prompt, tokens, step) -> float:
    """How far float32's greedy token `step` leads its runner-up, in nats."""
    logp = logprobs(model, torch.tensor([prompt + tokens[:step]]))[0, -1]  # [V]
    top = logp.topk(2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_engine_greedy_keeps_the_float32_pools_tokens(sharp_lm, kv_dtype):
    prompts = [[5, 17, 3, 99, 42, 8, 8, 61, 2, 30], [7, 1, 88], [14, 64, 9, 0, 12, 77, 3, 5, 5]]
    full, full_bytes = _greedy(sharp_lm, prompts, "float32")
    small, small_bytes = _greedy(sharp_lm, prompts, kv_dtype)
    agreed = 0
    for prompt, rows, full_rows in zip(prompts, small, full):
        ours, theirs = rows[0], full_rows[0]
        same = next((t for t, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(theirs))
        agreed += same
        if same < len(theirs):  # a compressed cache may only part ways at a near tie
            assert _margin(sharp_lm, prompt, theirs, same) < 0.05
    assert agreed >= 24
    assert small_bytes < full_bytes / 1.9
    shared, _ = _greedy(sharp_lm, prompts[:1], kv_dtype, n=3)  # samples share the prompt's KV
    assert shared == [small[0] * 3]
