"""Member pools (drafts, amateurs: engine/members.py) belong to the programs that use them:
freed when none does beyond `EngineConfig.idle_member_bytes`, the self-int4 draft built once
per target; and programs and member pools show in `Engine.stats` (/health, /metrics)."""

from __future__ import annotations

import engine_fixtures
import torch

import decodekit as dk
from decodekit.decode.beam import BeamProgram, beam_searches
from decodekit.decode.speculative import speculative_generate
from decodekit.engine.config import EngineConfig
from decodekit.engine.engine import Engine, engine_for, forget_engine
from decodekit.models.native import NativeLM

one_thread, sharp_lm = engine_fixtures.one_thread, engine_fixtures.sharp_lm  # fixtures

PROMPT = [(7 * i + 3) % 250 + 1 for i in range(40)]
GREEDY = dk.SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)


def copy_of(model: NativeLM, name: str) -> NativeLM:
    """Another model object over the same weights (a draft that agrees with the target)."""
    return NativeLM(model.net, model.config, tokenizer=model.tokenizer, name=name)


def test_self_int4_is_built_once_and_its_member_reused(sharp_lm):
    forget_engine(sharp_lm)
    want = dk.generate(sharp_lm, [PROMPT], GREEDY)[0][0].token_ids
    engine = engine_for(sharp_lm)
    members = []
    for _ in range(3):
        result = speculative_generate(sharp_lm, "self-int4", [PROMPT], GREEDY)
        assert result.completions[0][0].token_ids == want
        members.append(len(engine.members))
    assert members == [2, 2, 2]  # the engine's own and one int4 copy, not one per call
    engine.check()
    forget_engine(sharp_lm)


def test_unused_members_are_freed_beyond_the_idle_bound(sharp_lm):
    engine = Engine(sharp_lm, EngineConfig(idle_member_bytes=0))
    want = None
    for i in range(3):
        draft = copy_of(sharp_lm, f"draft-{i}")  # a new draft object each time
        programs = _spec_programs(sharp_lm, draft)
        handles = [engine.add(p) for p in programs]
        while not all(h.done for h in handles):
            engine.step()
            assert len(engine.members) == 2 or all(h.done for h in handles)  # while it runs
        got = handles[0].result(0)[0].token_ids
        want = want or got
        assert got == want
        assert len(engine.members) == 1 and engine.stats()["members"] == {}
    engine.check()


def test_idle_members_are_kept_within_the_bound_least_recent_first(sharp_lm):
    drafts = [copy_of(sharp_lm, f"draft-{i}") for i in range(3)]
    probe = Engine(sharp_lm)
    _run_all(probe, _spec_programs(sharp_lm, drafts[0]))
    one = probe.members.of(drafts[0]).pool.nbytes
    engine = Engine(sharp_lm, EngineConfig(idle_member_bytes=2 * one))
    for draft in drafts:
        _run_all(engine, _spec_programs(sharp_lm, draft))
    assert set(engine.stats()["members"]) == {"draft-1", "draft-2"}  # draft-0 was freed
    assert all(m["idle"] and m["used_blocks"] == 0 for m in engine.stats()["members"].values())


def test_programs_and_member_pools_show_in_stats(sharp_lm):
    engine = Engine(sharp_lm)
    searches = beam_searches(sharp_lm, [PROMPT] * 3, GREEDY, num_beams=2)
    handles = [engine.add(BeamProgram(sharp_lm, s, i)) for i, s in enumerate(searches)]
    stats = engine.stats()
    assert stats["waiting_requests"] == 3 and stats["waiting_programs"] == 3
    engine.step()
    stats = engine.stats()
    assert stats["running_requests"] == 3 and stats["running_programs"] == 3
    assert stats["used_blocks"] > 0 and stats["running_sequences"] >= 3
    draft = copy_of(sharp_lm, "watched-draft")
    spec = [engine.add(p) for p in _spec_programs(sharp_lm, draft)]
    engine.step()
    member = engine.stats()["members"]["watched-draft"]
    assert member["used_blocks"] > 0 and not member["idle"] and member["bytes"] > 0
    while not all(h.done for h in handles + spec):
        engine.step()
    stats = engine.stats()
    assert stats["running_requests"] == 0 and stats["used_blocks"] == 0 and stats["held_blocks"] == 0
    assert stats["members"]["watched-draft"]["used_blocks"] == 0
    engine.check()


def _spec_programs(target, draft):
    from decodekit.decode.speculative import speculative_programs

    return speculative_programs(target, draft, [PROMPT], GREEDY, 3, "block", False, 16)


def _run_all(engine: Engine, programs) -> None:
    handles = [engine.add(p) for p in programs]
    while not all(h.done for h in handles):
        engine.step()
    with torch.inference_mode():
        engine.check()
