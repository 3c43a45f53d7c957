"""A step that raises (engine.py `Engine.step`): it fails exactly the requests it ran, rolls
back the KV slots it reserved before anything reaches the prefix cache, and leaves the
engine usable; every later request equals its output on a fresh engine."""

from __future__ import annotations

import engine_fixtures
import pytest
import torch

import decodekit as dk
from decodekit.decode.beam import BeamProgram, beam_searches
from decodekit.engine.block_pool import BlockManager, BlockPool, PoolCorrupted
from decodekit.engine.config import EngineConfig
from decodekit.engine.engine import Engine, engine_for, forget_engine
from decodekit.engine.prefix_cache import PrefixCache
from decodekit.engine.program import Program

one_thread, sharp_lm = engine_fixtures.one_thread, engine_fixtures.sharp_lm  # fixtures

PROMPT = [(7 * i + 3) % 250 + 1 for i in range(40)]  # 2 full blocks of 16 and 8 tokens
GREEDY = dk.SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)


class Boom(RuntimeError):
    pass


@pytest.fixture
def inject(sharp_lm):
    """inject(count, error): the model's next `count` forwards raise `error` in layer 1,
    after layer 0 has written its KV (a real failure leaves the reserved slots half written)."""
    hooks = []

    def arm(count: int = 1, error: type[BaseException] = Boom) -> None:
        left = [count]

        def hook(module, args):
            if left[0] > 0:
                left[0] -= 1
                raise error("injected: the forward failed after layer 0 wrote its KV")

        hooks.append(sharp_lm.net.layers[1].register_forward_pre_hook(hook))

    yield arm
    for hook in hooks:
        hook.remove()


def fresh_run(model, prompt, params=GREEDY) -> list[int]:
    engine = Engine(model, EngineConfig(prefix_caching=False))
    handle = engine.submit(prompt, params)
    while not handle.done:
        engine.step()
    return handle.result(0)[0].token_ids


def idle(engine: Engine) -> None:
    """Every pool idle and the books right."""
    engine.check()
    for member in engine.members:
        assert member.pool.num_used == 0 and member.pool.held == 0
    assert len(engine.running_kv) == 0 and not engine.scheduler.running and not engine.scheduler.running


def test_a_failed_beam_step_does_not_poison_the_prefix_cache(sharp_lm, inject):
    """The issue's reproduction, on the server's path (a background thread keeps the engine):
    a beam program whose first forward raises, then a greedy request for the same prompt.
    Before the fix the reserved-but-unwritten prompt blocks were registered when the failed
    program closed, and the greedy request reused them."""
    want = fresh_run(sharp_lm, PROMPT)
    engine = Engine(sharp_lm)
    engine.start()
    try:
        inject()
        [search] = beam_searches(sharp_lm, [PROMPT], GREEDY.replace(max_new_tokens=5), num_beams=2)
        with pytest.raises(Boom):
            engine.add(BeamProgram(sharp_lm, search, 0)).result(30)
        got = engine.submit(PROMPT, GREEDY).result(30)[0]
        assert got.token_ids == want
        assert engine.stats()["prefix_cache_hit_tokens"] == 0  # nothing was registered
        again = engine.submit(PROMPT, GREEDY).result(30)[0]  # and a real hit is still right
        assert again.usage.cached_prompt_tokens == 32 and again.token_ids == want
    finally:
        engine.stop()
    idle(engine)


def test_a_failed_step_fails_its_requests_and_the_waiting_ones_run(sharp_lm, inject):
    engine = Engine(sharp_lm, EngineConfig(max_running=1))
    first = engine.submit(PROMPT, GREEDY)
    second = engine.submit(PROMPT[:30], GREEDY)  # waits: one sequence at a time
    engine.step()  # the first request prefills and decodes
    inject()
    with pytest.raises(Boom):
        engine.step()
    with pytest.raises(Boom):
        first.result(0)
    while not second.done:
        engine.step()
    assert second.result(0)[0].token_ids == fresh_run(sharp_lm, PROMPT[:30])
    assert _drain(engine)[0].token_ids == fresh_run(sharp_lm, PROMPT)
    idle(engine)


def _drain(engine: Engine):
    handle = engine.submit(PROMPT, GREEDY)
    while not handle.done:
        engine.step()
    return handle.result(0)


def test_an_adapter_that_raises_fails_its_step_and_nothing_else_breaks(sharp_lm):
    forget_engine(sharp_lm)

    def bad(logits, state):
        raise ValueError("adapter failed")

    with pytest.raises(ValueError, match="adapter failed"):
        dk.generate(sharp_lm, [PROMPT], GREEDY, adapter=bad)
    engine = engine_for(sharp_lm)
    idle(engine)
    [[got]] = dk.generate(sharp_lm, [PROMPT], GREEDY)
    assert got.token_ids == fresh_run(sharp_lm, PROMPT)
    forget_engine(sharp_lm)


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_an_interrupted_generate_leaves_the_shared_engine_usable(sharp_lm, inject, error):
    forget_engine(sharp_lm)
    engine = engine_for(sharp_lm)
    dk.generate(sharp_lm, [PROMPT[:20]], GREEDY)  # something in the prefix cache
    inject(error=error)
    with pytest.raises(error):
        dk.generate(sharp_lm, [PROMPT, PROMPT[3:]], GREEDY.replace(n=2))
    assert engine_for(sharp_lm) is engine  # kept, with its cache
    idle(engine)
    got = dk.generate(sharp_lm, [PROMPT, PROMPT[3:]], GREEDY)
    assert [c[0].token_ids for c in got] == [fresh_run(sharp_lm, p) for p in (PROMPT, PROMPT[3:])]
    assert engine.resets == 0
    forget_engine(sharp_lm)


def test_books_that_disagree_after_a_failure_reset_the_engine(sharp_lm):
    engine = Engine(sharp_lm)
    handle = engine.submit(PROMPT, GREEDY)
    engine.step()
    forward = engine._forward

    def corrupting(model, *args):  # an interrupt between two updates of the books
        engine._forward = forward
        engine.pool.refs[engine.pool.fresh - 1] += 1
        raise Boom("after corrupting a reference count")

    engine._forward = corrupting
    with pytest.raises(Boom):
        engine.step()
    assert engine.resets == 1 and handle.done
    idle(engine)
    assert _drain(engine)[0].token_ids == fresh_run(sharp_lm, PROMPT)


def test_rollback_gives_back_reserved_blocks_and_check_catches_wrong_counts():
    pool = BlockPool(1, 8, 4, 1, 2, prefix_cache=PrefixCache())
    manager = BlockManager(pool)
    table = manager.new_table([1, 2, 3, 4, 5])
    manager.reserve(table, 5)
    manager.register(table, [1, 2, 3, 4, 5], 5)  # block 0 full and cached
    pool.journal = {}
    manager.reserve(table, 6)  # 11 positions: 3 blocks
    assert len(table.blocks) == 3 and pool.num_used == 3
    manager.rollback()
    assert table.length == 5 and len(table.blocks) == 2 and pool.num_used == 2
    pool.check([table])
    pool.refs[1] += 1
    with pytest.raises(PoolCorrupted, match="reference counts"):
        pool.check([table])  # a raise, not an assert: python -O keeps it
    pool.refs[1] -= 1
    pool.free.append(pool.free[0]) if pool.free else pool.free.append(table.blocks[0])
    with pytest.raises(PoolCorrupted):
        pool.check([table])


def test_fail_all_waits_for_a_running_step(sharp_lm):
    engine = Engine(sharp_lm)
    handle = engine.submit(PROMPT, GREEDY)
    engine.step()
    assert engine._step_lock.acquire(timeout=1)
    try:
        import threading

        done = threading.Event()
        thread = threading.Thread(target=lambda: (engine.fail_all(Boom("stop")), done.set()))
        thread.start()
        assert not done.wait(0.2)  # blocked behind the step lock
    finally:
        engine._step_lock.release()
    thread.join(10)
    assert done.is_set() and handle.done
    with pytest.raises(Boom):
        handle.result(0)
    idle(engine)
    assert torch.is_inference_mode_enabled() is False


class _FailsAdmission(Program):
    """A program whose admission raises once `armed` (its `needs`, read by the scheduler)."""

    def __init__(self, model):
        self.model, self.armed = model, False

    def needs(self, block_size):
        if self.armed:
            raise Boom("injected: the program's admission failed")
        return [(self.model, 1)]

    def step(self, kv):
        raise AssertionError("never admitted")


def test_a_failed_admission_fails_that_request_and_the_waiting_ones_run(sharp_lm):
    """The queued-requests rule (engine/failure.py): an error that comes with one entry's
    admission fails that entry; the requests queued behind it go on, even with nothing
    running (they used to fail with it)."""
    engine = Engine(sharp_lm)
    program = _FailsAdmission(sharp_lm)
    failing = engine.add(program)
    program.armed = True
    waiting = engine.submit(PROMPT, GREEDY)
    with pytest.raises(Boom):
        engine.step()
    with pytest.raises(Boom, match="admission failed"):
        failing.result(0)
    while not waiting.done:
        engine.step()
    assert waiting.result(0)[0].token_ids == fresh_run(sharp_lm, PROMPT)
    idle(engine)


def test_a_failure_of_the_engines_own_state_fails_the_queued_requests(sharp_lm, monkeypatch):
    """An error no entry can be blamed for (here the scheduler's bookkeeping) fails what is
    queued, so a step that would fail again is not retried for ever; the engine stays usable."""
    engine = Engine(sharp_lm)
    queued = engine.submit(PROMPT, GREEDY)
    hold = engine.scheduler.hold
    monkeypatch.setattr(engine.scheduler, "hold", lambda: (_ for _ in ()).throw(Boom("books")))
    with pytest.raises(Boom):
        engine.step()
    with pytest.raises(Boom, match="books"):
        queued.result(0)
    monkeypatch.setattr(engine.scheduler, "hold", hold)
    assert _drain(engine)[0].token_ids == fresh_run(sharp_lm, PROMPT)
    idle(engine)
