"""The engine is lossless: batched, continuous, preempted, cached and forked runs give the
tokens of the plain one-request loop; and its request API behaves."""

from __future__ import annotations

import asyncio

import engine_fixtures
import pytest

import decodekit as dk
from decodekit.decode.sample import _steps
from decodekit.engine.config import EngineConfig
from decodekit.engine.engine import Engine, EngineFull
from decodekit.request import emit, make_requests

one_thread, sharp_lm = engine_fixtures.one_thread, engine_fixtures.sharp_lm  # fixtures

PROMPTS = [[5, 17, 3, 99, 42, 8, 8, 61, 2, 30], [7, 1, 88], [64, 9, 0, 12, 77, 3, 50, 6, 6, 1, 2, 3, 4]]
GREEDY = dk.SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


def engine(model, **changes) -> Engine:
    return Engine(model, EngineConfig(**{"block_size": 4, "num_blocks": 64, "compile": False, **changes}))


@pytest.fixture(params=[False, True], ids=["eager", "compiled"])
def compile_step(request, monkeypatch):
    """The engine's compiled decode step off and on (engine/compiled.py; traced with the
    "aot_eager" backend, which compiles in seconds): the outputs are the eager engine's."""
    from decodekit.engine import compiled

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    return request.param


def alone_completions(model, prompt, params):
    eng = engine(model)
    handle = eng.submit(prompt, params)
    run(eng, handle)
    return handle.result(0)


def alone(model, prompt, params) -> list[list[int]]:
    return [c.token_ids for c in alone_completions(model, prompt, params)]


def run(eng: Engine, *handles) -> None:
    """Step the engine until the handles are done (no thread)."""
    while not all(h.done for h in handles):
        eng.step()


def plain_loop(model, prompts, params) -> list[list[list[int]]]:
    """Token ids from decode/sample.py's plain loop (contiguous cache, no engine)."""
    requests = make_requests(model, prompts, params)
    out = [[None] * r.params.n for r in requests]
    for rows in _steps(model, requests):
        for delta in emit(rows, model.max_context):
            if delta.completion is not None:
                out[delta.prompt_index][delta.sample_index] = delta.completion.token_ids
    return out


def test_greedy_batched_equals_unbatched(sharp_lm, compile_step):
    eng = engine(sharp_lm, compile=compile_step)
    handles = [eng.submit(p, GREEDY) for p in PROMPTS]
    run(eng, *handles)
    for prompt, handle in zip(PROMPTS, handles):
        [completion] = handle.result(0)
        assert len(completion.token_ids) == 12
        assert [completion.token_ids] == alone(sharp_lm, prompt, GREEDY)


def test_seeded_samples_are_batch_invariant(sharp_lm, compile_step):
    params = dk.SamplingParams(max_new_tokens=10, seed=3, n=2, top_k=20, ignore_eos=True)
    others = [dk.SamplingParams(max_new_tokens=6, seed=s, temperature=0.7) for s in (1, 2)]
    eng = engine(sharp_lm, compile=compile_step)
    first = eng.submit(PROMPTS[0], others[0])
    mine = eng.submit(PROMPTS[1], params)
    last = eng.submit(PROMPTS[2], others[1])
    run(eng, first, mine, last)
    assert [c.token_ids for c in mine.result(0)] == alone(sharp_lm, PROMPTS[1], params)


def test_engine_equals_the_plain_loop(sharp_lm):
    params = [dk.SamplingParams(max_new_tokens=9, seed=5, n=3, top_p=0.9, ignore_eos=True),
              GREEDY, dk.SamplingParams(max_new_tokens=7, seed=8, repetition_penalty=1.3)]
    want = plain_loop(sharp_lm, PROMPTS, params)
    got = dk.generate(sharp_lm, PROMPTS, params)  # NativeLM: the engine
    assert [[c.token_ids for c in cs] for cs in got] == want
    [[handle_completion]] = [alone_completions(sharp_lm, PROMPTS[1], GREEDY)]
    assert got[1][0].logprobs == pytest.approx(handle_completion.logprobs, abs=1e-4)


def test_a_request_joining_a_running_batch_gets_its_solo_output(sharp_lm, compile_step):
    eng = engine(sharp_lm, compile=compile_step)
    early = [eng.submit(p, GREEDY) for p in PROMPTS[:2]]
    for _ in range(5):
        eng.step()
    params = dk.SamplingParams(max_new_tokens=8, seed=4)
    late = eng.submit(PROMPTS[2], params)
    eng.step()
    assert eng.stats()["running_requests"] == 3  # decoding beside the first two
    run(eng, late, *early)
    assert not compile_step or eng.compiled.steps > 0
    assert [c.token_ids for c in late.result(0)] == alone(sharp_lm, PROMPTS[2], params)
    assert [c.token_ids for c in early[0].result(0)] == alone(sharp_lm, PROMPTS[0], GREEDY)


def test_n_samples_prefill_the_prompt_once(sharp_lm):
    eng = engine(sharp_lm)
    params = dk.SamplingParams(max_new_tokens=6, seed=1, n=4, ignore_eos=True)
    handle = eng.submit(PROMPTS[2], params)
    eng.step()
    eng.step()
    # the four rows continue one shared copy of the prompt's KV and hold one token each
    prefixes = eng.running_kv.prefixes
    assert len(prefixes) == 4 and all(p is prefixes[0] for p in prefixes)
    assert prefixes[0].length == len(PROMPTS[2]) and eng.running_kv.lengths == [1] * 4
    run(eng, handle)
    assert eng.stats()["prefill_tokens"] == len(PROMPTS[2])
    assert eng.stats()["generated_tokens"] == 4 * 6
    assert [c.token_ids for c in handle.result(0)] == plain_loop(sharp_lm, [PROMPTS[2]], params)[0]


def test_prefix_cache_reuses_a_prompt_across_requests(sharp_lm):
    eng = engine(sharp_lm)
    first = eng.submit(PROMPTS[2], GREEDY)
    run(eng, first)
    again = eng.submit(PROMPTS[2] + [9, 9], GREEDY)
    run(eng, again)
    stats = eng.stats()
    assert stats["prefix_cache_hit_tokens"] == 12  # three full blocks of 4
    assert stats["prefill_tokens"] == 13 + 3
    assert [again.result(0)[0].token_ids] == alone(sharp_lm, PROMPTS[2] + [9, 9], GREEDY)


def test_preemption_under_a_small_memory_bound_is_lossless(sharp_lm, compile_step):
    params = dk.SamplingParams(max_new_tokens=24, seed=2, n=2, ignore_eos=True)
    # each request alone needs <= 3 + 2 * 7 blocks
    eng = engine(sharp_lm, num_blocks=18, compile=compile_step)
    handles = [eng.submit(p, params) for p in PROMPTS]
    run(eng, *handles)
    stats = eng.stats()
    assert stats["preemptions"] > 0
    assert stats["peak_used_blocks"] <= 18
    for prompt, handle in zip(PROMPTS, handles):
        assert [c.token_ids for c in handle.result(0)] == alone(sharp_lm, prompt, params)


def test_requests_in_lockstep_and_programs_share_a_tight_pool(sharp_lm, compile_step):
    """Requests whose sequences all cross a block boundary in the same step (same prompt
    length) count each other's new blocks (they once each saw the same free block and the
    pool ran out); beam programs beside them keep their held blocks and are never
    preempted. Everything finishes as it would alone, and every block returns."""
    from decodekit.decode.beam import BeamProgram, BeamSearch

    params = dk.SamplingParams(max_new_tokens=24, seed=3, n=2, ignore_eos=True)
    prompts = [f"ab{c}" for c in "cdefgh"]  # one length: every row needs a block at once
    beam = dk.SamplingParams(max_new_tokens=16, ignore_eos=True)

    def search(i):
        return BeamSearch(sharp_lm, sharp_lm.encode(f"zz{i}"), beam, 2, 1.0, True, None, sharp_lm.decode)

    eng = engine(sharp_lm, num_blocks=40, compile=compile_step)
    programs = [eng.add(BeamProgram(sharp_lm, search(i), i)) for i in range(2)]
    handles = [eng.submit(p, params) for p in prompts]
    run(eng, *handles, *programs)
    assert eng.stats()["preemptions"] > 0 and eng.pool.num_used == 0
    for prompt, handle in zip(prompts, handles):
        assert [c.token_ids for c in handle.result(0)] == alone(sharp_lm, prompt, params)
    for i, handle in enumerate(programs):
        want = dk.beam_search(sharp_lm, f"zz{i}", beam, num_beams=2)
        assert [c.token_ids for c in handle.result(0)] == [c.token_ids for c in want]


def test_cancel_frees_the_blocks_at_the_next_step(sharp_lm):
    eng = engine(sharp_lm, prefix_caching=False)
    handle = eng.submit(PROMPTS[0], dk.SamplingParams(max_new_tokens=20, n=2, seed=0))
    for _ in range(3):
        eng.step()
    assert eng.stats()["used_blocks"] > 0
    handle.cancel()
    eng.step()
    assert eng.stats()["used_blocks"] == 0 and eng.stats()["running_requests"] == 0
    completions = handle.result(0)
    assert [c.finish_reason for c in completions] == ["cancelled", "cancelled"]
    assert [len(c.token_ids) for c in completions] == [3, 3]


def test_submit_validates_and_bounds_the_queue(sharp_lm):
    eng = engine(sharp_lm, max_waiting=2)
    with pytest.raises(ValueError, match="outside"):
        eng.submit([5, 10**6], GREEDY)
    with pytest.raises(ValueError, match="KV blocks"):
        eng.submit(PROMPTS[0], GREEDY.replace(max_new_tokens=80, n=8))
    with pytest.raises(TypeError, match="SamplingParams"):
        eng.submit(PROMPTS[0], {"temperature": 0})
    eng.submit(PROMPTS[0], GREEDY)
    eng.submit(PROMPTS[1], GREEDY)
    with pytest.raises(EngineFull):
        eng.submit(PROMPTS[2], GREEDY)
    assert eng.stats()["waiting_requests"] == 2


def test_a_step_wakes_an_event_loop_once_for_all_its_readers(sharp_lm):
    """What a step produces reaches asyncio readers in one call into their loop (not one per
    request); `abatches` hands each reader every delta, once."""
    eng = engine(sharp_lm)

    async def read_all():
        loop = asyncio.get_running_loop()
        calls = []
        threadsafe = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args: calls.append(args) or threadsafe(*args)
        params = dk.SamplingParams(max_new_tokens=10, seed=1, n=3, ignore_eos=True)
        handles = [eng.submit(prompt, params) for prompt in PROMPTS]

        async def batches(handle):
            return [batch async for batch in handle.abatches()]

        eng.start()
        return await asyncio.gather(*(batches(handle) for handle in handles)), len(calls)

    try:
        read, calls = asyncio.run(read_all())
    finally:
        eng.stop()
    assert 0 < calls <= eng.steps
    for batches in read:
        assert sum(len(d.token_ids) for batch in batches for d in batch) == 3 * 10  # every token, once


def test_background_thread_streams_to_iterators_and_asyncio(sharp_lm):
    eng = engine(sharp_lm)
    eng.start()
    try:
        params = dk.SamplingParams(max_new_tokens=10, seed=6, n=2, ignore_eos=True)
        blocking = eng.submit(PROMPTS[0], params, request_id="a")
        deltas = list(blocking)
        assert blocking.request_id == "a" and blocking.done
        ends = {d.sample_index: d.completion for d in deltas if d.completion is not None}
        assert [ends[0].token_ids, ends[1].token_ids] == alone(sharp_lm, PROMPTS[0], params)
        assert "".join(d.text for d in deltas if d.sample_index == 0) == ends[0].text
        for sample, end in ends.items():  # each token comes once, with its text
            mine = [d for d in deltas if d.sample_index == sample]
            assert [t for d in mine for t in d.token_ids] == end.token_ids
            assert [x for d in mine for x in d.logprobs] == end.logprobs

        async def consume():
            handle = eng.submit(PROMPTS[1], GREEDY)
            return [d async for d in handle.aiter()]

        streamed = asyncio.run(consume())
        [final] = [d.completion for d in streamed if d.completion is not None]
        assert [final.token_ids] == alone(sharp_lm, PROMPTS[1], GREEDY)
        assert all(d.prompt_index == 0 for d in streamed)
    finally:
        eng.stop()
