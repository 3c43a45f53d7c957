"""The persistent engine per model (engine/engine.py `engine_for`): later calls reuse earlier calls' KV,
and reusing it changes no output; concurrent callers get their own results; the pool
stays within its bound."""

from __future__ import annotations

import threading

import engine_fixtures
import pytest
import torch

import decodekit as dk
from decodekit.engine.config import EngineConfig
from decodekit.engine.engine import Engine, engine_for, forget_engine
from decodekit.models.native import NativeLM

one_thread, sharp_lm = engine_fixtures.one_thread, engine_fixtures.sharp_lm  # fixtures

PROMPT = [(7 * i + 3) % 250 + 1 for i in range(40)]  # 2 full blocks of 16 and 8 tokens
GREEDY = dk.SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
SEEDED = dk.SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, n=3, seed=5)


@pytest.fixture
def fresh(sharp_lm):
    """sharp_lm with an empty persistent engine (and none left behind)."""
    forget_engine(sharp_lm)
    yield sharp_lm
    forget_engine(sharp_lm)


def counters(model) -> tuple[int, int]:
    stats = engine_for(model).stats()
    return stats["prefill_tokens"], stats["prefix_cache_hit_tokens"]


def generate(model, prompt: list[int], params) -> list:
    """`dk.generate` of one prompt of token ids: its n completions."""
    return dk.generate(model, [prompt], params)[0]


def fresh_engine_run(model, prompt, params):
    """The same request on a new engine with no prefix cache: the reference."""
    engine = Engine(model, EngineConfig(prefix_caching=False))
    handle = engine.submit(prompt, params)
    while not handle.done:
        engine.step()
    return handle.result(0)


def test_generate_reuses_one_engine_and_a_repeated_prompt_computes_only_its_last_block(fresh):
    first = generate(fresh, PROMPT, GREEDY)
    engine = engine_for(fresh)
    before = counters(fresh)
    second = generate(fresh, PROMPT, GREEDY)
    assert engine_for(fresh) is engine
    computed, cached = (after - b for after, b in zip(counters(fresh), before))
    assert (computed, cached) == (8, 32)  # the partial last block only
    assert second[0].usage.cached_prompt_tokens == 32
    assert second[0].token_ids == first[0].token_ids


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prefix_cache_hit_equals_miss(fresh, params):
    reference = fresh_engine_run(fresh, PROMPT, params)
    generate(fresh, PROMPT + [9, 9], params.replace(max_new_tokens=20))  # fills the cache
    before = counters(fresh)
    hit = generate(fresh, PROMPT, params)
    assert counters(fresh)[1] - before[1] == 32
    for got, want in zip(hit, reference, strict=True):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-4, rtol=0)


def test_extending_a_finished_text_reuses_all_of_its_kv(fresh):
    [parent] = generate(fresh, PROMPT, GREEDY)
    child_prompt = PROMPT + parent.token_ids + [11, 12]
    before = counters(fresh)
    [child] = generate(fresh, child_prompt, GREEDY)
    computed, cached = (after - b for after, b in zip(counters(fresh), before))
    # The parent computed its prompt and all its tokens but the last; its partially filled
    # last block is cached too, so the child computes only what the parent never did.
    assert cached == len(PROMPT) + len(parent.token_ids) - 1
    assert computed == 3
    [want] = fresh_engine_run(fresh, child_prompt, GREEDY)
    assert child.token_ids == want.token_ids


def test_batch_invariant_hit_is_bit_identical_and_the_flag_rebuilds_the_engine(sharp_lm):
    model = NativeLM(sharp_lm.net, sharp_lm.config, batch_invariant=True)
    first = generate(model, PROMPT, SEEDED)
    engine = engine_for(model)
    assert engine.batch_invariant
    second = generate(model, PROMPT, SEEDED)
    assert engine.stats()["prefix_cache_hit_tokens"] >= 32
    for a, b in zip(first, second, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    model.batch_invariant = False
    assert engine_for(model) is not engine and not engine_for(model).batch_invariant


def test_changed_weights_get_a_new_engine(sharp_lm):
    model = NativeLM(sharp_lm.net, sharp_lm.config)
    engine = engine_for(model)
    assert engine_for(model) is engine
    with torch.no_grad():
        model.net.norm.weight.mul_(1.0)  # an in-place write: its KV may be stale
    assert engine_for(model) is not engine


def test_two_threads_generating_concurrently_get_their_own_results(fresh):
    prompts = [PROMPT[:20], PROMPT[5:33], PROMPT[:20] + [4, 4, 4], PROMPT[10:]]
    expected = [generate(fresh, p, GREEDY)[0].token_ids for p in prompts]
    forget_engine(fresh)
    barrier = threading.Barrier(2)
    results: dict[int, list] = {0: [], 1: []}
    errors = []

    def work(worker: int):
        try:
            barrier.wait()
            for round_ in range(3):
                mine = prompts[worker::2] if round_ % 2 == 0 else prompts[1 - worker :: 2]
                got = dk.generate(fresh, mine, GREEDY)
                results[worker].append((mine, [c[0].token_ids for c in got]))
        except BaseException as error:  # noqa: BLE001 -- reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors and all(len(r) == 3 for r in results.values())
    for worker_results in results.values():
        for mine, tokens in worker_results:
            assert tokens == [expected[prompts.index(p)] for p in mine]
    assert engine_for(fresh).stats()["used_blocks"] == 0


def test_pool_stays_within_its_bound_and_evicts_idle_cached_blocks(fresh):
    config = EngineConfig(num_blocks=12)
    engine = engine_for(fresh, config)
    assert engine.pool.num_blocks == 12
    prompts = [[(p * 31 + i) % 250 + 1 for i in range(40)] for p in range(6)]
    for prompt in prompts:  # 4 blocks each: the cache fills and must evict
        [got] = generate(fresh, prompt, GREEDY)
        [want] = fresh_engine_run(fresh, prompt, GREEDY)
        assert got.token_ids == want.token_ids
        assert engine_for(fresh, config) is engine
        stats = engine.stats()
        assert stats["used_blocks"] == 0 and stats["cached_blocks"] <= 12
        assert engine.pool.keys.shape[2] <= 12 and stats["peak_used_blocks"] <= 12
    assert engine.pool.num_free == 0  # every block holds some cached KV: eviction ran
    [again] = generate(fresh, prompts[-1], GREEDY)  # the latest prompt is still cached
    assert again.usage.cached_prompt_tokens == 32


def test_a_request_larger_than_the_pool_runs_on_its_own_engine(fresh):
    engine = engine_for(fresh, EngineConfig(num_blocks=2))
    [got] = generate(fresh, PROMPT, GREEDY)
    assert got.token_ids == fresh_engine_run(fresh, PROMPT, GREEDY)[0].token_ids
    assert engine.stats()["steps"] == 0


def test_closing_a_stream_early_frees_its_blocks(fresh):
    pieces = dk.stream(fresh, PROMPT, GREEDY.replace(max_new_tokens=30))
    next(pieces)
    pieces.close()
    stats = engine_for(fresh).stats()
    assert stats["running_requests"] == 0 and stats["used_blocks"] == 0
