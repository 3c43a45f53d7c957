"""Contrastive decoding on the expert's engine (ContrastiveProgram, and beam search as a
BeamProgram over the pair) equals the plain loop.

Both models run NativeLM's batch-invariant mode, so a token's logits are bit-identical
whether the plain loop computes them over its dense, left-padded cache or the engine over
KV blocks beside other requests (tests/engine/test_batch_invariant.py): the two paths must
then agree exactly, tokens, logprobs and finish reasons.
"""

from __future__ import annotations

import pytest
import torch

import decodekit as dk
from decodekit.decode.beam import _beam_plain, beam_searches
from decodekit.decode.contrastive import ContrastiveLM, ContrastiveProgram
from decodekit.decode.sample import _steps, stream_events
from decodekit.engine import Engine, EngineConfig
from decodekit.engine.engine import engine_for
from decodekit.models.native import NativeLM
from decodekit.request import emit, make_requests, to_completion

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

PROMPTS = ["ROMEO: But soft", "the sun", "O, what a light through yonder"]


@pytest.fixture(scope="module")
def expert(tiny_llama_dir) -> NativeLM:
    return NativeLM.from_pretrained(tiny_llama_dir, batch_invariant=True)


@pytest.fixture(scope="module")
def amateur(tiny_llama_dir, expert) -> NativeLM:
    """One layer, other random weights, the expert's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(tiny_llama_dir)
    config.num_hidden_layers = 1
    torch.manual_seed(5)
    hf = LlamaForCausalLM(config)
    return NativeLM.from_state_dict(config.to_dict(), dict(hf.state_dict()), name="amateur",
                                    tokenizer=expert.tokenizer, eos_token_ids=expert.eos_token_ids,
                                    batch_invariant=True)  # fmt: skip


def plain(cd: ContrastiveLM, prompts, params):
    """The plain loop's completions and each sample's delta texts, per prompt."""
    requests = make_requests(cd, prompts, params)
    texts = {}
    for rows in _steps(cd, requests):
        for delta in emit(rows, cd.max_context):
            texts.setdefault((delta.prompt_index, delta.sample_index), []).append(delta.text)
    return [[to_completion(row) for row in r.rows] for r in requests], texts


def outputs(completions) -> list[tuple]:
    return [(c.token_ids, c.text, c.logprobs, c.processed_logprobs, c.top_logprobs, c.finish_reason,
             c.stop_reason) for c in completions]  # fmt: skip


PARAMS = [
    dk.SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True),
    [dk.SamplingParams(max_new_tokens=10, seed=3, n=3, top_k=40, temperature=1.2, logprobs=2),
     dk.SamplingParams(max_new_tokens=14, seed=4, n=4, top_p=0.9, stop=["e"],
                       stop_token_ids=list(range(1, 300, 6))),  # rows that end at different steps
     dk.SamplingParams(max_new_tokens=6, seed=5, repetition_penalty=1.3, ignore_eos=True)],
]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_engine_equals_the_plain_loop(expert, amateur, params):
    cd = ContrastiveLM(expert, amateur, alpha=0.05, amateur_temperature=0.8)
    assert cd.engine_programs(make_requests(cd, PROMPTS, params)) is not None
    want, want_texts = plain(cd, PROMPTS, params)
    texts, got = {}, [[None] * len(w) for w in want]
    for delta in stream_events(cd, PROMPTS, params):  # the expert's engine
        texts.setdefault((delta.prompt_index, delta.sample_index), []).append(delta.text)
        if delta.completion is not None:
            got[delta.prompt_index][delta.sample_index] = delta.completion
    for g, w in zip(got, want, strict=True):
        assert outputs(g) == outputs(w)
    assert texts == want_texts  # the same deltas, as they came
    engine = engine_for(expert)  # the expert's persistent engine ran them
    assert engine.steps > 0
    assert engine.pool.num_used == 0 and engine.members.of(amateur).pool.num_used == 0


def test_programs_batch_with_other_requests_on_one_engine(expert, amateur):
    """Contrastive requests of two pairs beside a sampling request on the expert: each equals
    its run alone; one forward of each model per step; every block returns."""
    params = PARAMS[1]
    cd = ContrastiveLM(expert, amateur, alpha=0.1)
    sharp = ContrastiveLM(expert, amateur, alpha=0.2, amateur_weight=0.5)
    engine = Engine(expert, EngineConfig(block_size=4, num_blocks=256))
    handles = [engine.add(ContrastiveProgram(model, request))
               for model in (cd, sharp) for request in make_requests(model, PROMPTS, params)]  # fmt: skip
    other = dk.SamplingParams(max_new_tokens=8, seed=9, n=2)
    sampling = engine.submit("JULIET:", other)
    while engine.has_work():
        engine.step()
    assert engine.steps <= max(p.max_new_tokens for p in params)  # one forward per step for all
    got = [h.result() for h in handles]
    want = plain(cd, PROMPTS, params)[0] + plain(sharp, PROMPTS, params)[0]
    for g, w in zip(got, want, strict=True):
        assert outputs(g) == outputs(w)
    assert outputs(sampling.result()) == outputs(dk.generate(expert, "JULIET:", other))
    assert engine.pool.num_used == 0 and engine.members.of(amateur).pool.num_used == 0
    assert len(engine.running_kv) == 0 and not engine.scheduler.running


def test_windowed_amateur_runs_the_plain_loop(expert, amateur):
    cd = ContrastiveLM(expert, amateur, alpha=0.05, amateur_window=3)
    params = dk.SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    assert cd.engine_programs(make_requests(cd, PROMPTS, params)) is None
    got = dk.generate(cd, PROMPTS, params)
    for prompt, [c] in zip(PROMPTS, got, strict=True):
        ids = expert.encode(prompt)
        for token in c.token_ids:  # each step: the expert on all of it, the amateur on the last 3
            e = expert.forward(torch.tensor([ids]), expert.new_cache(1))[0, -1]
            a = amateur.forward(torch.tensor([ids[-3:]]), amateur.new_cache(1))[0, -1]
            assert token == int(cd.scores(e, a).argmax())
            ids.append(token)
        assert len(c.token_ids) == 8


def test_cancelled_program_frees_blocks_in_both_pools(expert, amateur):
    cd = ContrastiveLM(expert, amateur)
    engine = Engine(expert, EngineConfig(block_size=4, num_blocks=128))
    [request] = make_requests(cd, ["ROMEO:"], dk.SamplingParams(max_new_tokens=40, n=3, seed=1,
                                                                ignore_eos=True))
    handle = engine.add(ContrastiveProgram(cd, request))
    for _ in range(5):
        engine.step()
    member = engine.members.of(amateur)
    assert engine.pool.num_used > 0 and member.pool.num_used > 0 and len(engine.running_kv) == 3
    handle.cancel()
    engine.step()
    completions = handle.result()
    assert [c.finish_reason for c in completions] == ["cancelled"] * 3
    assert all(len(c.token_ids) == 5 for c in completions)
    assert engine.pool.num_used == 0 and member.pool.num_used == 0
    assert len(engine.running_kv) == 0 and not engine.scheduler.running


def test_stream_on_the_engine_equals_generate(expert, amateur):
    cd = ContrastiveLM(expert, amateur, alpha=0.1)
    params = dk.SamplingParams(max_new_tokens=10, seed=7)
    [c] = dk.generate(cd, "the sun", params)
    assert "".join(dk.stream(cd, "the sun", params)) == c.text



BEAMS = [dict(num_beams=2), dict(num_beams=4, length_penalty=0.5, early_stopping=False)]


def beam_outputs(completions) -> list[tuple]:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in completions]


def assert_same_beams(got, want):
    for g, w in zip(got, want, strict=True):
        assert beam_outputs(g) == beam_outputs(w)
        assert [c.score for c in g] == pytest.approx([c.score for c in w], abs=1e-4)
        assert [c.logprobs for c in g] == [pytest.approx(c.logprobs, abs=1e-4) for c in w]


@pytest.mark.parametrize("options", BEAMS, ids=["2-beams", "4-beams-exhaustive"])
def test_beam_on_the_engine_equals_the_plain_loop(expert, amateur, options):
    cd = ContrastiveLM(expert, amateur, alpha=0.05, amateur_temperature=0.8)
    params = dk.SamplingParams(max_new_tokens=10, n=2)
    assert cd.engine_programs(beam_searches(cd, PROMPTS, params, **options)) is not None
    want = [_beam_plain(cd, search) for search in beam_searches(cd, PROMPTS, params, **options)]
    engine = engine_for(expert)
    steps = engine.steps
    got = dk.beam_search(cd, PROMPTS, params, **options)  # the expert's persistent engine
    assert engine.steps > steps
    assert_same_beams(got, want)
    assert engine.pool.num_used == 0 and engine.members.of(amateur).pool.num_used == 0
    assert len(engine.running_kv) == 0 and not engine.scheduler.running


def test_concurrent_beam_searches_batch_on_one_engine(expert, amateur):
    """Three contrastive beam searches and a contrastive sampling request in flight together:
    one step per token for all of them, each equal to its plain-loop run."""
    cd = ContrastiveLM(expert, amateur, alpha=0.1)
    params = dk.SamplingParams(max_new_tokens=8, n=3, ignore_eos=True)
    engine = Engine(expert, EngineConfig(block_size=4, num_blocks=512))
    model, programs = cd.engine_programs(beam_searches(cd, PROMPTS, params, num_beams=3))
    assert model is expert
    handles = [engine.add(program) for program in programs]
    sampling = dk.SamplingParams(max_new_tokens=8, seed=2, n=2)
    [request] = make_requests(cd, ["JULIET:"], sampling)
    sampled = engine.add(ContrastiveProgram(cd, request))
    amateur_peak = 0
    while engine.has_work():
        engine.step()
        amateur_peak = max(amateur_peak, engine.members.of(amateur).pool.num_used)
    assert engine.steps == 8  # every search advanced in the same steps
    assert amateur_peak > 0  # the amateur's beams lived in its member pool
    want = [_beam_plain(cd, search) for search in beam_searches(cd, PROMPTS, params, num_beams=3)]
    assert_same_beams([h.result() for h in handles], want)
    assert outputs(sampled.result()) == outputs(plain(cd, ["JULIET:"], sampling)[0][0])
    assert engine.pool.num_used == 0 and engine.members.of(amateur).pool.num_used == 0


def test_windowed_amateur_beam_runs_the_plain_loop(expert, amateur):
    cd = ContrastiveLM(expert, amateur, alpha=0.05, amateur_window=3)
    params = dk.SamplingParams(max_new_tokens=6)
    assert cd.engine_programs(beam_searches(cd, PROMPTS, params, num_beams=2)) is None
    got = dk.beam_search(cd, PROMPTS, params, num_beams=2)
    want = [_beam_plain(cd, search) for search in beam_searches(cd, PROMPTS, params, num_beams=2)]
    assert_same_beams(got, want)
