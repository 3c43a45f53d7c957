"""The compiled decode step (engine/compiled.py) computes what the eager engine computes:
greedy and seeded tokens equal with it on and off, for sampling requests (one row, padded
buckets; n samples of one prompt keep the eager cascade attention), beam search,
speculative and contrastive programs, int8 and int4 models; a failed compilation leaves the
engine eager with one warning; the automatic policy never compiles for a short run.

Most tests compile with the "aot_eager" backend: dynamo traces the same step (NativeLM's
modules with `LaneAttention`), in seconds; one test runs inductor itself."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time

import engine_fixtures
import pytest
import torch

import decodekit as dk
from decodekit.decode.beam import BeamProgram, beam_searches
from decodekit.decode.contrastive import ContrastiveLM, ContrastiveProgram
from decodekit.decode.speculative import speculative_programs
from decodekit.engine import compiled
from decodekit.engine.block_pool import BlockPool
from decodekit.engine.compile_policy import CompilePolicy
from decodekit.engine.compiled import bucket
from decodekit.engine.config import EngineConfig
from decodekit.engine.engine import Engine
from decodekit.engine.lanes import lanes_for
from decodekit.engine.rows import GatheredRows
from decodekit.models import kernels
from decodekit.models.half_linear import keep_half_weights
from decodekit.models.native import NativeLM
from decodekit.request import make_requests

one_thread, sharp_lm = engine_fixtures.one_thread, engine_fixtures.sharp_lm  # fixtures

PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for i in range(5 + 9 * j)] for j in range(3)]
GREEDY = dk.SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
SEEDED = dk.SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, seed=5, n=3, ignore_eos=True)


@pytest.fixture(autouse=True)
def fast_backend(monkeypatch):
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")


def fresh(model: NativeLM) -> NativeLM:
    """Another model object over the same weights: no compiled steps yet (`lanes_for` keeps
    them on the model object)."""
    return NativeLM(model.net, model.config, tokenizer=model.tokenizer, name=model.name)


def run(model, items, mode):
    """Every item (prompt ids for `GREEDY`, or a (prompt, params) pair, or a program) on a
    fresh engine with compile=`mode`; their token ids, and the engine."""
    engine = Engine(model, EngineConfig(compile=mode, block_size=4, num_blocks=512))
    handles = []
    for item in items:
        if isinstance(item, tuple):
            handles.append(engine.submit(item[0], item[1]))
        elif isinstance(item, list):
            handles.append(engine.submit(item, GREEDY))
        else:
            handles.append(engine.add(item))
    while engine.has_work():
        engine.step()
    engine.check()
    return [[c.token_ids for c in h.result(0)] for h in handles], engine


@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_tokens_equal_the_eager_engine(sharp_lm, rows):
    want, _ = run(sharp_lm, PROMPTS[:rows], False)
    got, engine = run(sharp_lm, PROMPTS[:rows], True)
    assert got == want
    assert (bucket(rows), False) in engine.lanes.ready  # 3 rows: the bucket of 4, one padded
    assert engine.compiled.steps >= GREEDY.max_new_tokens - 2  # all but the prompt's steps


def test_seeded_samples_equal_the_eager_engine(sharp_lm):
    one = SEEDED.replace(n=1)
    items = [(PROMPTS[0], one), (PROMPTS[1], one.replace(seed=6)), (PROMPTS[2], GREEDY)]
    want, _ = run(sharp_lm, items, False)
    got, engine = run(sharp_lm, items, True)
    assert got == want and engine.compiled.steps > 0


def test_samples_of_one_prompt_read_their_shared_prefix_in_the_graph(sharp_lm):
    """n samples share their prompt's KV (rows.py): the prefixed variant of the bucket reads
    it once, beside rows of another request that hold their whole sequence; equal to eager."""
    items = [(PROMPTS[0], SEEDED), (PROMPTS[1], SEEDED.replace(n=1, seed=9))]
    model = fresh(sharp_lm)
    want, _ = run(model, items, False)
    got, engine = run(model, items, True)
    assert got == want and engine.compiled.steps >= SEEDED.max_new_tokens - 2
    assert (4, True) in engine.lanes.ready and (4, False) not in engine.lanes.ready


def test_rows_of_two_shared_prefixes_read_each_its_own(sharp_lm):
    """Two requests' samples continue two prefixes (joined in one PrefixKV, each row seeing
    its own span) beside a request of its own; equal to eager."""
    items = [(PROMPTS[0], SEEDED), (PROMPTS[1], SEEDED.replace(n=1)), (PROMPTS[2], SEEDED.replace(seed=8))]
    want, _ = run(sharp_lm, items, False)
    got, engine = run(sharp_lm, items, True)
    assert got == want and engine.compiled.steps >= SEEDED.max_new_tokens - 2


def test_prefix_kv_joins_prefixes_once_and_gives_each_row_its_span():
    from decodekit.engine.lanes import PrefixKV
    from decodekit.engine.rows import SharedPrefix

    a = SharedPrefix(torch.randn(2, 1, 1, 3, 4), torch.randn(2, 1, 1, 3, 4))
    b = SharedPrefix(torch.randn(2, 1, 1, 5, 4), torch.randn(2, 1, 1, 5, 4))
    assert PrefixKV.for_rows([None, None], None) is None
    one = PrefixKV.for_rows([a, None, a], None)
    assert one.keys is a.keys and one.bounds([a, None, a]) == [[0, 0, 0], [3, 0, 3]]
    both = PrefixKV.for_rows([b, a, None], one)
    assert both.bounds([b, a, None]) == [[0, 5, 0], [5, 8, 0]]
    assert torch.equal(both.keys[:, :, :, 5:], a.keys) and torch.equal(both.values[:, :, :, :5], b.values)
    assert PrefixKV.for_rows([a, b], both) is not both  # another order: joined anew
    assert PrefixKV.for_rows([b, b, a], both) is both  # the same prefixes: kept


def test_beam_search_equals_the_eager_engine(sharp_lm):
    def programs():
        searches = beam_searches(sharp_lm, PROMPTS[:2], GREEDY, num_beams=3)
        return [BeamProgram(sharp_lm, search, i) for i, search in enumerate(searches)]

    want, _ = run(sharp_lm, programs(), False)
    got, engine = run(sharp_lm, programs(), True)
    assert got == want and engine.compiled.steps > 0


def test_speculative_programs_equal_the_eager_engine(sharp_lm):
    draft = dk.models.native.NativeLM(sharp_lm.net, sharp_lm.config, name="draft")

    def programs():
        return speculative_programs(sharp_lm, draft, PROMPTS[:2], GREEDY, 3, "block", False, 16)

    want, _ = run(sharp_lm, [*programs(), PROMPTS[2]], False)
    got, _ = run(sharp_lm, [*programs(), PROMPTS[2]], True)
    assert got == want


def noisy_draft(model: NativeLM) -> NativeLM:
    """Another model over `model`'s shape, its weights moved by noise: a draft that accepts
    some of its tokens, not all."""
    net = copy.deepcopy(model.net)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in net.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=generator))
    return NativeLM(net, model.config, name="noisy-draft")


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_speculative_drafts_and_verifications_run_compiled(sharp_lm, params):
    # The draft's forwards that feed one token a sequence run its compiled step over rows
    # gathered from its pool (rounds.py `member_forward`), and a step that only verifies runs
    # the target's compiled step of its span (compile_policy.py `CompiledSpans`); greedy tokens
    # equal plain decoding, seeded samples the eager engine's.
    draft = noisy_draft(sharp_lm)

    def programs():
        return speculative_programs(sharp_lm, draft, PROMPTS, params, 3, "block", False, 16, fallback=False)

    want, _ = run(sharp_lm, programs(), False)
    compiled_programs = programs()
    got, engine = run(sharp_lm, compiled_programs, True)
    assert got == want
    member = engine.members.of(draft).compiled
    assert (bucket(len(PROMPTS) * params.n), False) in member.lanes.ready and member.steps > 0
    spans = engine.spans.by_span
    assert (bucket(len(PROMPTS) * params.n), False) in spans[4].lanes.ready and spans[4].steps > 0  # γ + 1
    accepted = sum(p.stats.accepted_tokens for p in compiled_programs)
    assert 0 < accepted < sum(p.stats.drafted_tokens for p in compiled_programs)  # a draft that errs
    if params is GREEDY:
        plain, _ = run(sharp_lm, PROMPTS, False)
        assert got == plain


def test_gathered_rows_hold_each_tables_keys_in_order():
    pool = BlockPool(2, 8, 4, 2, 3, torch.float32)
    pool.keys.copy_(torch.randn(pool.keys.shape))
    pool.values.copy_(torch.randn(pool.values.shape))
    rows = GatheredRows(pool, [[5, 2], [7]], [6, 3])
    assert rows.keys.shape == (2, 2, 2, 8, 3)  # [N, R, H_kv, C, D]: C = the longest table's blocks
    for row, blocks in enumerate([[5, 2], [7]]):
        keys, values = pool.read(torch.tensor(blocks))
        width = 4 * len(blocks)
        assert torch.equal(rows.keys[:, row, :, :width], keys)
        assert torch.equal(rows.values[:, row, :, :width], values)
    rows.reserve_rows(4)  # a bucket of 4: two padding rows of zeros
    assert rows.keys.shape[1] == 4 and not rows.keys[:, 2:].any() and not rows.values[:, 2:].any()


def test_contrastive_programs_equal_the_eager_engine(sharp_lm, tiny_llama_dir):
    amateur = dk.models.native.NativeLM.from_pretrained(tiny_llama_dir)
    pair = ContrastiveLM(sharp_lm, amateur, alpha=0.1)

    def programs():
        return [ContrastiveProgram(pair, r) for r in make_requests(pair, PROMPTS[:2], GREEDY)]

    want, _ = run(sharp_lm, programs(), False)
    got, engine = run(sharp_lm, programs(), True)
    assert got == want and engine.compiled.steps > 0


def test_a_failed_compilation_leaves_the_engine_eager_with_one_warning(sharp_lm, monkeypatch):
    def broken(graph, inputs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(compiled, "BACKEND", broken)
    model = fresh(sharp_lm)
    want, _ = run(model, PROMPTS[:1], False)
    with pytest.warns(RuntimeWarning, match="stays eager") as caught:
        got, engine = run(model, PROMPTS[:1], True)
    assert got == want and engine.compiled.steps == 0 and "no compiler here" in engine.lanes.failed
    assert len([w for w in caught if "stays eager" in str(w.message)]) == 1


def test_the_automatic_policy_compiles_only_when_the_steps_so_far_repay_it(sharp_lm, tmp_path):
    policy = CompilePolicy(None, tmp_path / "times.json", "shape")  # nothing recorded: 40 s a bucket
    assert not policy.pays(1, 64, 0.002)  # hello world: 64 steps save ~0.04 s of a 40 s warm-up
    assert policy.pays(1, 100_000, 0.002)
    assert not policy.pays(16, 10**9, 1.0)  # beyond 8 rows, never by itself
    assert CompilePolicy(True, tmp_path / "t").pays(64, 0, 0.0)
    assert not CompilePolicy(False, tmp_path / "t").pays(1, 10**9, 1.0)
    policy.record(1, 3.5)
    assert policy.pays(1, 6_000, 0.002) and not policy.pays(2, 6_000, 0.002)  # bucket 2: unmeasured
    _, engine = run(fresh(sharp_lm), PROMPTS, None)  # a short run: eager, nothing compiled or compiling
    assert engine.compiled.steps == 0 and not engine.lanes.ready and not engine.lanes.compiling


def test_a_warm_up_is_recorded_and_read_back(sharp_lm, tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path))
    run(fresh(sharp_lm), PROMPTS[:1], True)
    recorded = CompilePolicy.for_model(sharp_lm, None)
    assert set(recorded.warmups) == {"rows=1"} and 0 < recorded.warmups["rows=1"] < 600


def test_engines_that_cannot_compile_say_why(tiny_llama_dir):
    model = dk.models.native.NativeLM.from_pretrained(tiny_llama_dir, batch_invariant=True)
    engine = Engine(model, EngineConfig(compile=True))
    assert engine.lanes is None and "batch-invariant" in engine.compile_refused
    int8 = Engine(dk.models.native.NativeLM.from_pretrained(tiny_llama_dir), EngineConfig(kv_dtype="int8"))
    assert int8.lanes is None and "KV pool" in int8.compile_refused


@pytest.mark.parametrize("prefixed", [False, True])
def test_inductor_compiles_the_step_and_its_tokens_equal_eager(sharp_lm, monkeypatch, prefixed):
    """Inductor with its C++ wrapper; `prefixed`: three samples of one prompt beside a request
    of its own (the variant that reads a shared prefix, its length dynamic)."""
    monkeypatch.setattr(compiled, "BACKEND", "inductor")
    model = fresh(sharp_lm)
    items = [(PROMPTS[0], SEEDED), PROMPTS[1]] if prefixed else PROMPTS[:1]
    want, _ = run(model, items, False)
    got, engine = run(model, items, True)
    assert got == want and engine.compiled.steps > 0
    assert list(engine.lanes.ready) == [(bucket(len(items) + 2 * prefixed), prefixed)]
    with torch.inference_mode():
        engine.check()


def test_the_automatic_policy_compiles_in_the_background_and_switches_over(sharp_lm, tmp_path, monkeypatch):
    """A recorded warm-up of a millisecond: the first decode step asks for its bucket, the
    engine goes on eager while a thread compiles it, and then runs it; tokens as eager."""
    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path))
    CompilePolicy.for_model(sharp_lm, None).record(1, 0.001)
    long = dk.SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    model = fresh(sharp_lm)
    want, _ = run(model, [(PROMPTS[1], long)], False)
    engine = Engine(model, EngineConfig(compile=None, block_size=4, num_blocks=512))
    handle = engine.submit(PROMPTS[1], long)
    engine.step()
    engine.step()  # the first decode step: eager, and the bucket of 1 starts compiling
    assert engine.lanes.compiling == ["rows=1"] and engine.compiled.steps == 0
    assert engine.stats()["compiling"] == ["rows=1"]
    engine.lanes.wait()
    while engine.has_work():
        engine.step()
    assert [c.token_ids for c in handle.result(0)] == want[0] and engine.compiled.steps > 0


def test_a_models_engines_share_its_compiled_steps(sharp_lm):
    """Compiled once: a later engine of the same model (automatic policy, short run) uses
    the buckets an earlier one compiled; a model whose weights changed gets new ones."""
    model = fresh(sharp_lm)
    run(model, PROMPTS[:1], True)
    want, _ = run(model, PROMPTS[:1], False)
    got, engine = run(model, PROMPTS[:1], None)
    assert got == want and engine.compiled.steps > 0
    assert lanes_for(model) is engine.lanes
    with torch.no_grad():
        model.net.norm.weight.mul_(1.0)  # an in-place change: a new weights stamp
    assert lanes_for(model) is not engine.lanes


@pytest.mark.parametrize(("bits", "group"), [(8, None), (4, 32)])
def test_quantised_models_compile_with_their_kernels_and_equal_eager(sharp_lm, bits, group):
    """The packed kernels run inside the graph (their fake kernels: models/kernels.py)."""
    from decodekit.compress.recipe import CompressConfig, quantized_copy

    model = quantized_copy(sharp_lm, CompressConfig("rtn", bits=bits, group_size=group))
    want, _ = run(model, PROMPTS[:2], False)
    got, engine = run(model, PROMPTS[:2], True)
    assert got == want and engine.compiled.steps > 0 and engine.lanes.failed is None


HOOKS = (torch.nn.Module.__call__, torch.nn.Module.__getattr__)  # what a tracer patches process-wide


def test_eager_steps_beside_a_compilation_never_see_a_tracers_hooks(sharp_lm, tmp_path, monkeypatch):
    """The automatic policy compiles a bucket while the engine goes on eager: hundreds of
    eager steps run meanwhile, none of them fails or runs while torch.fx's tracer has
    `torch.nn.Module.__call__` patched (issue 37: a step failed with `NameError: module is
    not installed as a submodule`), and the compiled bucket then gives the eager tokens."""
    from decodekit.engine.batch import paged_forward

    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path))
    CompilePolicy.for_model(sharp_lm, None).record(1, 0.001)
    long = dk.SamplingParams(temperature=0, max_new_tokens=80, ignore_eos=True)
    model = fresh(sharp_lm)
    [want], _ = run(model, [(PROMPTS[0], long)], False)
    engine = Engine(model, EngineConfig(compile=None, block_size=4, num_blocks=512))
    hooked = []  # per eager step: whether a tracer's hooks were in place

    def forward(*args):
        hooked.append((torch.nn.Module.__call__, torch.nn.Module.__getattr__) != HOOKS)
        return paged_forward(*args)

    engine._forward = forward
    handles = [engine.submit(PROMPTS[0], long)]
    engine.step()
    engine.step()  # the first decode step asks for the bucket of 1
    assert engine.lanes._pending == {(1, False)}
    deadline = time.monotonic() + 300
    while engine.lanes._pending and time.monotonic() < deadline:
        if not engine.has_work():
            handles.append(engine.submit(PROMPTS[0], long))
        engine.step()
        time.sleep(0.002)  # a server between requests: the compilation gets a core on a busy machine
    eager_steps = len(hooked)
    assert not engine.lanes._pending and engine.lanes.failed is None
    assert eager_steps >= 100, eager_steps  # the compilation overlapped many steps
    assert not any(hooked), f"{sum(hooked)} of {eager_steps} eager steps ran under a tracer's hooks"
    handles.append(engine.submit(PROMPTS[0], long))
    while engine.has_work():
        engine.step()
    assert all(h.result(0)[0].token_ids == want[0] for h in handles) and engine.compiled.steps > 0


EXIT_SCRIPT = """
import json, sys
import decodekit as dk
from decodekit.engine.compile_policy import shape_key
from decodekit.engine.compiled import BUCKETS, bucket_name
from decodekit.engine.lanes import lanes_for
from decodekit.engine.rows import GatheredRows

model = dk.load_model("shakespeare")
times = {f"{shape_key(model)}/{bucket_name(b, p)}": 0.01 for b in BUCKETS for p in (False, True)}
open(sys.argv[1] + "/compile-times.json", "w").write(json.dumps(times))
lanes = lanes_for(model)
rounds = 0
for i in range(20):
    dk.generate(model, ["ROMEO:", "JULIET: O"], dk.SamplingParams(n=2, max_new_tokens=8, seed=i))
    dk.beam_search(model, "KING:", dk.SamplingParams(max_new_tokens=6), num_beams=3)
    rounds += bool(lanes._pending)
    if rounds == 3:  # a few calls beside the compilation, as a script would go on
        break
assert lanes._pending, "no compilation started"
print("compiling at exit")
"""


def test_a_script_exits_cleanly_while_a_bucket_compiles(tmp_path):
    """`generate` and `beam_search` until the automatic policy compiles a bucket, then the
    script ends: exit code 0 and nothing on stderr (issue 37: SIGABRT, `terminate called
    without an active exception`)."""
    env = {**os.environ, "DECODEKIT_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=600, check=False)  # fmt: skip
    assert (done.returncode, done.stderr, done.stdout.strip()) == (0, "", "compiling at exit")


def test_a_model_with_biases_compiles_with_inductors_python_wrapper(sharp_lm, monkeypatch):
    """torch 2.13's inductor C++ wrapper corrupted the heap around a decodekit op given a bias
    (qwen2.5-0.5b's q/k/v biases, 16 layers, an AVX-512 CPU: lanes.py `has_biases`): a model
    with biases compiles with the Python wrapper, one without keeps the C++ one. (The options
    are recorded and the step runs uncompiled: an inductor compile of the biased model takes
    ~40 s.)"""
    from decodekit.engine import lanes
    from decodekit.models.shapes import random_model

    qwen = random_model("qwen2.5-0.5b", layers=1)  # q/k/v biases
    assert lanes.has_biases(qwen) and not lanes.has_biases(sharp_lm)
    assert "cpp_wrapper" not in lanes.compile_options("inductor", model=qwen)
    assert lanes.compile_options("inductor", model=sharp_lm)["cpp_wrapper"] is True
    seen = []

    def record(step, **kwargs):
        seen.append(kwargs["options"])
        return step

    monkeypatch.setattr(compiled, "BACKEND", "inductor")
    monkeypatch.setattr(lanes.torch, "compile", record)
    for model, wrapper in ((qwen, False), (fresh(sharp_lm), True)):
        seen.clear()
        run(model, PROMPTS[:1], True)
        assert seen and all(options.get("cpp_wrapper", False) is wrapper for options in seen)


@pytest.mark.skipif(not kernels.available(), reason="the compiled step traces the kernels' op")
def test_half_weights_compile_and_equal_the_eager_engine(sharp_lm):
    """A float32 model keeping float16 linear weights (models/half_linear.py): the compiled
    step traces the kernel over them as the eager step runs it."""
    state = copy.deepcopy(sharp_lm.net).half().float().state_dict()  # values float16 holds
    net = copy.deepcopy(sharp_lm.net)
    net.load_state_dict(state)
    model = NativeLM(net, sharp_lm.config, tokenizer=sharp_lm.tokenizer, name="half-weights")
    assert keep_half_weights(model.net, torch.float16) > 0
    want, _ = run(model, PROMPTS[:2], False)
    got, engine = run(model, PROMPTS[:2], True)
    assert got == want and engine.compiled.steps >= GREEDY.max_new_tokens - 2
