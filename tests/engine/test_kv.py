"""Paged KV blocks: paged attention equals the contiguous forward; fork, crop and the
prefix cache are lossless; the memory bound holds and eviction spares blocks in use."""

from __future__ import annotations

import engine_fixtures
import pytest
import torch

from decodekit.engine.batch import build_batch, paged_forward
from decodekit.engine.block_pool import BlockManager, BlockPool, BlockTable, OutOfBlocks, PoolCorrupted
from decodekit.engine.config import EngineConfig
from decodekit.engine.engine import Engine
from decodekit.engine.prefix_cache import PrefixCache
from decodekit.engine.rows import RunningKV

one_thread, sharp_lm = engine_fixtures.one_thread, engine_fixtures.sharp_lm  # fixtures

TOKENS = [5, 17, 3, 99, 42, 8, 8, 61, 2, 30, 7, 1, 88, 14, 64, 9, 0, 12, 77, 3]
TOL = 1e-4


def manager_for(model, num_blocks=32, block_size=4, cache=True) -> BlockManager:
    c = model.config
    pool = BlockPool(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                     prefix_cache=PrefixCache() if cache else None)  # fmt: skip
    return BlockManager(pool)


def extend(model, manager, table: BlockTable, tokens: list[int], count: int) -> torch.Tensor:
    """Compute the last `count` of `tokens` into `table`; logits [V] of the last one."""
    slots = manager.reserve(table, count)
    logits = paged_forward(model, *build_batch(manager.pool, [(table, tokens, slots)]))
    manager.register(table, tokens, table.length)
    return logits[0]


def reference(model, tokens: list[int]) -> torch.Tensor:
    """Next-token logits [V] after `tokens` from NativeLM's contiguous cache."""
    return model.forward(torch.tensor([tokens]), model.new_cache(1))[0, -1]


def test_prefill_then_decode_equals_the_contiguous_forward(sharp_lm):
    manager = manager_for(sharp_lm)
    table = BlockTable()
    got = [extend(sharp_lm, manager, table, TOKENS, 7)]  # 1 full block of 4 and 3 more
    got += [extend(sharp_lm, manager, table, TOKENS[: n + 1], 1) for n in range(7, 13)]
    want = [reference(sharp_lm, TOKENS[: n + 1]) for n in range(6, 13)]
    assert table.length == 13 and len(table.blocks) == 4
    assert reference(sharp_lm, TOKENS[:7]).abs().max() > 1.0  # the logits are not all ~0
    for g, w in zip(got, want):
        assert (g - w).abs().max() <= TOL


def test_sequences_of_different_lengths_in_one_forward_equal_each_alone(sharp_lm):
    manager = manager_for(sharp_lm)
    lengths = [3, 9, 14]
    tables = [BlockTable() for _ in lengths]
    for table, n in zip(tables, lengths):
        extend(sharp_lm, manager, table, TOKENS[:n], n)
    # one step: two sequences decode one token, the third prefills 4 more at once
    items = [(tables[0], TOKENS[:4], manager.reserve(tables[0], 1)),
             (tables[1], TOKENS[:10], manager.reserve(tables[1], 1)),
             (tables[2], TOKENS[:18], manager.reserve(tables[2], 4))]  # fmt: skip
    logits = paged_forward(sharp_lm, *build_batch(manager.pool, items))  # [3, V]
    for row, end in enumerate([4, 10, 18]):
        assert (logits[row] - reference(sharp_lm, TOKENS[:end])).abs().max() <= TOL


def test_fork_shares_full_blocks_and_equals_a_fresh_prefill(sharp_lm):
    manager = manager_for(sharp_lm, cache=False)
    pool = manager.pool
    parent = BlockTable()
    extend(sharp_lm, manager, parent, TOKENS[:10], 10)  # blocks: full, full, 2 of 4
    child = manager.fork(parent)
    assert child.blocks[:2] == parent.blocks[:2]
    assert [pool.refs[b] for b in parent.blocks] == [2, 2, 1]
    assert child.blocks[2] != parent.blocks[2]  # the partial block was copied
    a = extend(sharp_lm, manager, parent, TOKENS[:10] + [11], 1)
    b = extend(sharp_lm, manager, child, TOKENS[:10] + [50], 1)
    assert (a - reference(sharp_lm, TOKENS[:10] + [11])).abs().max() <= TOL
    assert (b - reference(sharp_lm, TOKENS[:10] + [50])).abs().max() <= TOL
    manager.free(child)
    assert [pool.refs[b] for b in parent.blocks] == [1, 1, 1]
    manager.free(parent)
    assert pool.num_used == 0 and pool.num_free == pool.num_blocks


def test_crop_then_extend_equals_never_extended(sharp_lm):
    manager = manager_for(sharp_lm, cache=False)
    table = BlockTable()
    extend(sharp_lm, manager, table, TOKENS[:9], 9)
    extend(sharp_lm, manager, table, TOKENS[:13], 4)  # draft tokens, then rejected
    manager.crop(table, 9)
    assert table.length == 9 and len(table.blocks) == 3
    ours = TOKENS[:9] + [40, 41]
    extend(sharp_lm, manager, table, ours[:10], 1)
    got = extend(sharp_lm, manager, table, ours, 1)
    assert (got - reference(sharp_lm, ours)).abs().max() <= TOL


def test_a_programs_fork_and_crop_refuse_what_would_corrupt_its_kv(sharp_lm):
    """A program that forks a sequence with uncomputed tokens, or crops one on a lane, gets
    a ValueError (which ends that program, rounds.py), not an assert that `python -O` drops."""
    from decodekit.engine.program import ProgramKV

    engine = Engine(sharp_lm, EngineConfig(block_size=4, num_blocks=32, compile=False))
    kv = ProgramKV(sharp_lm, engine.members.of)
    seq = kv.open(sharp_lm, TOKENS[:6])
    with pytest.raises(ValueError, match="6 pending"):
        kv.fork(seq)
    seq.lane = 0  # as if it held RunningKV row 0
    with pytest.raises(ValueError, match="leave_lane"):
        kv.crop(seq, 3)
    assert seq.tokens == TOKENS[:6]  # nothing cropped


def test_crop_into_a_shared_block_copies_it_before_writing(sharp_lm):
    manager = manager_for(sharp_lm, cache=False)
    parent = BlockTable()
    extend(sharp_lm, manager, parent, TOKENS[:12], 12)  # three full blocks
    child = manager.fork(parent)
    manager.crop(child, 6)  # inside the second block, which the parent still reads
    shared = parent.blocks[1]
    assert child.blocks == parent.blocks[:2]
    got = extend(sharp_lm, manager, child, TOKENS[:6] + [70, 71], 2)
    assert child.blocks[1] != shared  # copy-on-write
    assert (got - reference(sharp_lm, TOKENS[:6] + [70, 71])).abs().max() <= TOL
    after = extend(sharp_lm, manager, parent, TOKENS[:13], 1)  # the parent is untouched
    assert (after - reference(sharp_lm, TOKENS[:13])).abs().max() <= TOL


def test_prefix_cache_hit_gives_the_same_logits_as_a_miss(sharp_lm):
    manager = manager_for(sharp_lm)
    first = BlockTable()
    extend(sharp_lm, manager, first, TOKENS[:10], 10)
    full_blocks = first.blocks[:2]
    manager.free(first)  # its two full blocks stay cached, idle
    assert len(manager.pool.cache) == 2 and manager.pool.cache.num_idle == 2
    prompt = TOKENS[:10] + [33, 34, 35]
    hit = manager.new_table(prompt)
    assert hit.length == 8 and hit.blocks == full_blocks
    got = extend(sharp_lm, manager, hit, prompt, len(prompt) - hit.length)
    cold = manager_for(sharp_lm, cache=False)
    miss = BlockTable()
    want = extend(sharp_lm, cold, miss, prompt, len(prompt))
    assert (got - want).abs().max() <= TOL
    assert (got - reference(sharp_lm, prompt)).abs().max() <= TOL


def test_a_fully_cached_prompt_still_computes_its_last_token(sharp_lm):
    manager = manager_for(sharp_lm)
    first = BlockTable()
    extend(sharp_lm, manager, first, TOKENS[:8], 8)
    manager.free(first)
    again = manager.new_table(TOKENS[:8])
    assert again.length == 4  # the second block holds the last token: recomputed
    got = extend(sharp_lm, manager, again, TOKENS[:8], 4)
    assert (got - reference(sharp_lm, TOKENS[:8])).abs().max() <= TOL


def test_memory_bound_sets_the_number_of_blocks_and_is_never_exceeded(sharp_lm):
    c = sharp_lm.config
    block_bytes = 2 * c.num_layers * 4 * c.num_kv_heads * c.head_dim * 4  # float32
    engine = Engine(sharp_lm, EngineConfig(block_size=4, max_kv_bytes=10 * block_bytes + 7))
    assert engine.pool.num_blocks == 10 and engine.pool.bytes_per_block == block_bytes
    assert engine.pool.keys.numel() * 4 * 2 == 10 * block_bytes
    manager = BlockManager(engine.pool)
    table = BlockTable()
    manager.reserve(table, 40)  # all ten blocks
    with pytest.raises(OutOfBlocks):
        manager.reserve(table, 1)
    with pytest.raises(ValueError, match="max_kv_bytes"):
        Engine(sharp_lm, EngineConfig(block_size=4, max_kv_bytes=block_bytes - 1))


def test_eviction_takes_idle_blocks_least_recently_used_first_never_one_in_use(sharp_lm):
    manager = manager_for(sharp_lm, num_blocks=6)
    pool = manager.pool
    old, new = BlockTable(), BlockTable()
    extend(sharp_lm, manager, old, TOKENS[:5], 5)  # 1 full block cached + 1 partial
    extend(sharp_lm, manager, new, TOKENS[10:15], 5)
    old_cached = old.blocks[0]
    manager.free(old)
    manager.free(new)  # idle, LRU order: old's block, then new's
    reader = manager.new_table(TOKENS[10:15])  # reuses new's cached block: in use again
    assert reader.length == 4 and pool.refs[reader.blocks[0]] == 1
    in_use = reader.blocks[0]
    before = pool.keys[:, :, in_use].clone()
    taken = [pool.allocate() for _ in range(5)]  # 4 free blocks, then old's idle block
    assert taken[-1] == old_cached
    assert in_use not in taken
    with pytest.raises(OutOfBlocks):
        pool.allocate()  # the only cached block left is in use
    assert torch.equal(pool.keys[:, :, in_use], before)
    assert len(pool.cache) == 1  # old's entry was evicted, reader's kept


def test_engine_config_is_validated():
    with pytest.raises(ValueError, match="block_size must be an integer >= 1, got 0"):
        EngineConfig(block_size=0)
    with pytest.raises(TypeError, match="max_running must be an integer"):
        EngineConfig(max_running=2.5)
    with pytest.raises(ValueError, match="num_blocks"):
        EngineConfig(num_blocks=0)
    assert EngineConfig(num_blocks=7).num_blocks_for(10**9) == 7


def test_an_unset_kv_bound_is_the_devices(monkeypatch):
    """256 MiB on the CPU; on a GPU 40 % of its free memory when the pool is built (never below
    the CPU's), so a server on a large GPU is not held to a laptop's cache; a set bound wins."""
    from decodekit.engine import config as config_module

    assert EngineConfig().kv_bytes_for("cpu") == 256 * 2**20
    assert EngineConfig().num_blocks_for(2**20, "cpu") == 256
    free = {"bytes": 100 * 2**30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free["bytes"], 141 * 2**30))
    assert EngineConfig().kv_bytes_for("cuda") == int(config_module.GPU_KV_SHARE * 100 * 2**30) == 40 * 2**30
    free["bytes"] = 2**20  # a nearly full GPU: the CPU's bound
    assert EngineConfig().kv_bytes_for(torch.device("cuda", 0)) == 256 * 2**20
    assert EngineConfig(max_kv_bytes=5 * 2**20).kv_bytes_for("cuda") == 5 * 2**20


def test_reference_count_guards_raise_even_under_python_O(sharp_lm):
    """Guards of the KV's owners are raises (python -O strips asserts): a block released
    twice, handed out while referenced, or shared unreferenced without a prefix cache; a
    RunningKV row whose length disagrees with its table's."""
    manager = manager_for(sharp_lm, cache=False)
    pool = manager.pool
    block = pool.allocate()
    pool.release(block)
    with pytest.raises(PoolCorrupted, match=f"block {block} is released with 0 references"):
        pool.release(block)
    with pytest.raises(PoolCorrupted, match=f"block {block} is shared with no reference and no prefix cache"):
        pool.share(block)
    pool.refs[block] = 1  # books gone wrong: a free block that someone references
    with pytest.raises(PoolCorrupted, match=f"block {block} is handed out with 1 references"):
        pool.allocate()
    table = BlockTable()
    extend(sharp_lm, manager, table, TOKENS[:5], 5)
    running = RunningKV(pool)
    running.add(table, table.blocks, table.length)  # 5 positions, not grown for the new token
    slots = manager.reserve(table, 1)
    with pytest.raises(PoolCorrupted, match="RunningKV row 0 holds 5 positions and feeds 1 tokens"):
        build_batch(pool, [(table, TOKENS[:6], slots)], running)


def test_a_gpus_samples_share_their_prompt_where_the_copies_would_cost_more_than_its_kernels():
    """rows.py `shares`: on the CPU n samples always share their prompt's KV; on a GPU (a
    meta pool stands in: neither device's rule is the CPU's) only where the n - 1 copies
    would read at least GPU_SHARE_MIN_BYTES a layer each step, and never with sharing off
    (the batch-invariant mode, sliding windows)."""
    from decodekit.engine.rows import GPU_SHARE_MIN_BYTES

    def running(device, kv_heads, head_dim, share=True):
        pool = BlockPool(1, 8, 16, kv_heads, head_dim, dtype=torch.bfloat16, device=device)
        return RunningKV(pool, share_prefixes=share)

    qwen, llama = running("meta", 2, 64), running("meta", 8, 128)  # 512 B and 4 KiB a position and layer
    assert not qwen.shares(16, 512)  # the GPU benchmark's 16 samples of 512 tokens: 3.75 MiB of copies
    assert qwen.shares(64, 8_000) and llama.shares(16, 2_200) and not llama.shares(16, 2_000)
    least = GPU_SHARE_MIN_BYTES // 4096  # two samples: the one copy of keys and values
    assert llama.shares(2, least) and not llama.shares(2, least - 1)
    cpu = running("cpu", 2, 64)
    assert cpu.shares(2, 1) and cpu.shares(16, 512)
    assert not running("cpu", 2, 64, share=False).shares(16, 512)
    assert not running("meta", 8, 128, share=False).shares(64, 8_000)
