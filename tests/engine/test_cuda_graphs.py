"""The CUDA graphs' bookkeeping (engine/cuda_graphs.py), on the CPU: `GraphedLanes` with
`capture=False` runs every step through a bucket's own input tensors and the RunningKV
storage it was built on, as a replayed graph would, so these tests check the padding, the
copies in and out and the captures again when the rows grow; the capture itself runs in
tests/test_cuda.py on a GPU."""

from __future__ import annotations

import warnings

import engine_fixtures
import pytest
import torch

import decodekit as dk
from decodekit.bench.aten_calls import CountCalls
from decodekit.engine import compiled
from decodekit.engine.compiled import bucket
from decodekit.engine.config import EngineConfig
from decodekit.engine.cuda_graphs import GraphedLanes
from decodekit.engine.engine import Engine

one_thread, sharp_lm = engine_fixtures.one_thread, engine_fixtures.sharp_lm  # fixtures

PROMPTS = [[(5 * i + 7 * j) % 250 + 1 for i in range(4 + 6 * j)] for j in range(3)]


def run(model, items, graphed: bool, inductor: bool = False, fused: bool = True):
    """(prompt, params) items on a fresh engine, eager or through `GraphedLanes` (with the
    compiled step: `inductor`; its attention form: `fused`); their token ids and logprobs,
    and the engine."""
    engine = Engine(model, EngineConfig(compile=graphed or False, block_size=4, num_blocks=512))
    if graphed:
        lanes = GraphedLanes(model, inductor=inductor, capture=False, fused_attention=fused)
        engine.compiled.lanes = engine.lanes = lanes
    handles = [engine.submit(prompt, params) for prompt, params in items]
    while engine.has_work():
        engine.step()
    engine.check()
    results = [h.result(0) for h in handles]
    return [[(c.token_ids, c.logprobs) for c in r] for r in results], engine


@pytest.mark.parametrize("fused", [True, False], ids=["writing-sdpa", "written-out"])
def test_graphed_steps_equal_the_eager_engine_as_rows_leave_and_grow(sharp_lm, fused):
    """Three requests that end at different steps (buckets 4, 2, 1: padded rows), one long
    enough that RunningKV doubles its positions (64 -> 128): the graphs are built again
    over the new storage, and every token and logprob equals the eager engine's, in both
    attention forms. The writing form stores each new key in the running rows: a graph built
    while rows hold sequences must not store its placeholder keys there (it did: a wrong
    token)."""
    greedy = dk.SamplingParams(temperature=0, ignore_eos=True)
    items = [(PROMPTS[0], greedy.replace(max_new_tokens=90)),
             (PROMPTS[1], greedy.replace(max_new_tokens=9)),
             (PROMPTS[2], dk.SamplingParams(temperature=1.0, top_k=20, seed=3, max_new_tokens=20))]
    want, _ = run(sharp_lm, items, False)
    got, engine = run(sharp_lm, items, True, fused=fused)
    assert [tokens for [(tokens, _)] in got] == [tokens for [(tokens, _)] in want]
    # the graphed step attends over the rows' whole capacity, masked (written out, or SDPA
    # under an additive mask): the same sums in another order
    for [(_, ours)], [(_, eager)] in zip(got, want, strict=True):
        assert torch.allclose(torch.tensor(ours), torch.tensor(eager), atol=1e-5, rtol=0)
    lanes = engine.lanes
    assert engine.compiled.steps >= 85  # every decode-only step but the prompts'
    assert set(lanes.graphs) == {(bucket(1), False)}  # the buckets of 4 and 2 were dropped when the rows grew
    assert lanes.captures >= 4 and lanes.failed is None  # 4, 2, 1 rows, and 1 again over 128 positions
    assert lanes.graphs[(1, False)].keys is engine.running_kv.keys


def run_joining(model, graphed: bool, inductor: bool = False, fused: bool = True):
    """Four seeded samples of a short prompt and a greedy request; after five steps three
    samples of a 70-token prompt join, and the greedy request ends first. Their tokens and
    logprobs, and the engine."""
    engine = Engine(model, EngineConfig(compile=graphed or False, block_size=4, num_blocks=512))
    if graphed:
        lanes = GraphedLanes(model, inductor=inductor, capture=False, fused_attention=fused)
        engine.compiled.lanes = engine.lanes = lanes
    sampled = dk.SamplingParams(n=4, temperature=1.0, top_k=20, seed=5, max_new_tokens=40, ignore_eos=True)
    greedy = dk.SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=12)
    handles = [engine.submit(PROMPTS[1], sampled), engine.submit(PROMPTS[0], greedy)]
    shares = []
    for _ in range(5):
        engine.step()
        shares.append(sum(prefix is not None for prefix in engine.running_kv.prefixes))
    long = [(3 * i) % 250 + 1 for i in range(70)]
    handles.append(engine.submit(long, sampled.replace(n=3, seed=7, max_new_tokens=20)))
    while engine.has_work():
        engine.step()
        shares.append(sum(prefix is not None for prefix in engine.running_kv.prefixes))
    engine.check()
    results = [[(c.token_ids, c.logprobs) for c in h.result(0)] for h in handles]
    return results, engine, shares


@pytest.mark.parametrize("fused", [True, False], ids=["writing-sdpa", "written-out"])
def test_graphed_steps_read_shared_prefixes_as_the_eager_engine(sharp_lm, fused):
    """n samples of a prompt keep it once (rows.py `add_shared`) on a GPU too: their graphed
    steps read the prompt's keys from one prefix buffer, each row its span of it. Requests
    join (the 70-token prompt outgrows the buffer's first 64 positions: a new buffer, the
    prefixed graphs captured again) and leave (the prefixes copied again), and every token
    and logprob equals the eager engine's, whose rows merge the prefix by its log-sum-exp."""
    want, _, eager_shares = run_joining(sharp_lm, False)
    got, engine, shares = run_joining(sharp_lm, True, fused=fused)
    assert shares == eager_shares and max(shares) == 7  # 4 + 3 rows continue a prefix at once
    for ours, eager in zip(got, want, strict=True):
        assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in eager]
        for (_, a), (_, b) in zip(ours, eager, strict=True):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    lanes = engine.lanes
    assert lanes.failed is None and lanes.prefix_buffer[0].shape[3] == 128
    assert any(prefixed for _, prefixed in lanes.graphs)
    assert all(graph.prefix_keys is lanes.prefix_buffer[0] for (_, p), graph in lanes.graphs.items() if p)
    assert engine.compiled.steps >= 35  # the decode-only steps ran graphed, with and without a prefix


def test_the_compiled_step_in_the_graph_equals_the_eager_engine(sharp_lm, monkeypatch):
    """compile=True on a GPU: the step compiled once (here by "aot_eager", which traces the
    same step in seconds) for every bucket and length of the rows, then recorded."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    greedy = dk.SamplingParams(temperature=0, ignore_eos=True)
    items = [(PROMPTS[0], greedy.replace(max_new_tokens=70)), (PROMPTS[2], greedy.replace(max_new_tokens=8))]
    want, _ = run(sharp_lm, items, False)
    got, engine = run(sharp_lm, items, True, inductor=True)
    assert [tokens for [(tokens, _)] in got] == [tokens for [(tokens, _)] in want]
    assert engine.lanes._compiled and engine.lanes.captures >= 3 and engine.compiled.steps >= 65
    # and its prefixed step, over the samples' shared prompts
    want, _, _ = run_joining(sharp_lm, False)
    got, engine, _ = run_joining(sharp_lm, True, inductor=True)
    assert [[t for t, _ in r] for r in got] == [[t for t, _ in r] for r in want]
    assert True in engine.lanes._compiled  # every decode-only step there has a prefixed row


def test_a_graphs_logits_are_copied_out(sharp_lm):
    """A replay overwrites the graph's outputs: `run` hands out a copy of the logits."""
    engine = Engine(sharp_lm, EngineConfig(compile=True, block_size=4, num_blocks=64))
    lanes = GraphedLanes(sharp_lm, capture=False)
    engine.submit(PROMPTS[0], dk.SamplingParams(temperature=0, max_new_tokens=5))
    engine.step()  # the prompt: the sequence takes its lane
    kv = engine.running_kv
    kv.grow(1)
    first = torch.tensor([[3], [len(PROMPTS[0])], [kv.lengths[0] - 1]])
    with torch.inference_mode():  # as in an engine step
        logits = lanes.run(1, *first, kv)[0]
        kept = logits.clone()
        graph = lanes.graphs[(1, False)]
        other = lanes.run(1, *torch.tensor([[40], [0], [0]]), kv)[0]  # another token, seeing nothing
    assert lanes.graphs[(1, False)] is graph and not torch.equal(other, kept)
    assert torch.equal(logits, kept)


def test_a_failed_capture_leaves_the_engine_eager_with_one_warning(sharp_lm, monkeypatch):
    greedy = dk.SamplingParams(temperature=0, max_new_tokens=6)
    want, _ = run(sharp_lm, [(PROMPTS[0], greedy)], False)

    def broken(self, size, keys, values, prefix=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(GraphedLanes, "_new_graph", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, engine = run(sharp_lm, [(PROMPTS[0], greedy)], True)
    assert [tokens for [(tokens, _)] in got] == [tokens for [(tokens, _)] in want]
    assert engine.compiled.steps == 0
    assert "stream is capturing" in engine.lanes.failed and not engine.lanes.ready
    assert sum("CUDA graph" in str(w.message) for w in caught) == 1


def test_the_writing_step_attends_with_one_sdpa_call_a_layer(sharp_lm):
    """A replayed graph costs about its kernel count: the writing step's attention is two
    index writes and one SDPA call a layer, no softmax or concatenation written out, and its
    logits and new keys are the written-out step's; the rows hold the new keys after it."""
    config = sharp_lm.config
    shape = (config.num_layers, 2, config.num_kv_heads, 16, config.head_dim)
    keys, values = torch.randn(shape), torch.randn(shape)
    tokens, positions, stored = torch.tensor([[5], [9]]), torch.tensor([6, 3]), torch.tensor([6, 3])
    counts, outs = {}, {}
    for writes in (False, True):
        step = compiled.lanes_step(sharp_lm, f"step_{writes}", writes=writes)
        rows = (keys.clone(), values.clone())
        with torch.no_grad(), CountCalls() as counter:
            outs[writes] = step(tokens, positions, stored, *rows)
        counts[writes] = counter.calls
        if writes:
            for row, position in enumerate(stored.tolist()):
                assert torch.equal(rows[0][:, row, :, position], outs[writes][1][:, row])
                assert torch.equal(rows[1][:, row, :, position], outs[writes][2][:, row])
    sdpa = sum(n for name, n in counts[True].items() if "scaled_dot_product" in name)
    assert sdpa == config.num_layers and "_softmax" not in counts[True] and "cat" not in counts[True]
    assert counts[True]["index_put_"] == 2 * config.num_layers
    saved = (sum(counts[False].values()) - sum(counts[True].values())) / config.num_layers
    assert saved >= 10, (counts[False], counts[True])
    for ours, written in zip(outs[True], outs[False], strict=True):  # the same sums in another order
        assert torch.allclose(ours, written, atol=1e-4, rtol=0)
    assert torch.equal(outs[True][1][0], outs[False][1][0])  # the first layer's keys: before any attention
