"""Every path on a CUDA device (issues 15 and 33): every strategy of tests/test_devices.py
(which checks on the CPU that each names its tensors' devices) run on the GPU, greedy
output equal to the CPU's and seeded output equal to itself; bfloat16 and compressed models.
Marked `cuda`; they skip on a machine without a GPU (`pytest -m cuda` selects them;
scripts/gpu_check.sh runs them and the speed table)."""

from __future__ import annotations

import pytest
import torch

import decodekit as dk
from decodekit.models.base import prefill

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]  # fmt: skip

GREEDY = dk.SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
IDS = [0, 5, 17, 300, 1200, 42, 9]


@pytest.fixture(scope="module")
def pair():
    return dk.load_model("shakespeare"), dk.load_model("shakespeare", device="cuda")


def test_weights_cache_and_logits_live_on_the_device(pair):
    cpu, gpu = pair
    assert {p.device.type for p in gpu.net.parameters()} == {"cuda"}
    assert gpu.new_cache(1).keys.device.type == "cuda"
    logits = prefill(gpu, [IDS])[0]
    assert logits.device.type == "cuda" and logits.dtype == torch.float32
    torch.testing.assert_close(logits.cpu(), prefill(cpu, [IDS])[0], rtol=1e-3, atol=1e-3)


def test_generate_greedy_gives_the_cpus_tokens(pair):
    cpu, gpu = pair
    [a], [b] = dk.generate(cpu, ["ROMEO:"], GREEDY), dk.generate(gpu, ["ROMEO:"], GREEDY)
    assert a[0].token_ids == b[0].token_ids


def test_the_engine_batches_seeded_samples_on_the_device(pair):
    _, gpu = pair
    params = dk.SamplingParams(max_new_tokens=16, n=3, seed=7, ignore_eos=True, top_p=0.9,
                               repetition_penalty=1.1, logprobs=2)  # fmt: skip
    first = dk.generate(gpu, ["ROMEO:", "JULIET: O Romeo"], params)
    again = dk.generate(gpu, ["ROMEO:", "JULIET: O Romeo"], params)
    assert [[c.token_ids for c in group] for group in first] == [[c.token_ids for c in g] for g in again]
    assert all(len(c.token_ids) == 16 and len(c.top_logprobs) == 16 for group in first for c in group)


def test_speculative_decoding_on_the_device_matches_greedy(pair):
    cpu, gpu = pair
    draft = dk.load_model("shakespeare-draft", device="cuda")
    result = dk.speculative_generate(gpu, draft, "ROMEO:", GREEDY)
    [expected] = dk.generate(cpu, "ROMEO:", GREEDY)
    assert result.completions[0].token_ids == expected.token_ids


def test_bfloat16_on_the_device():
    model = dk.load_model("shakespeare", dtype="bfloat16", device="cuda")
    [completion] = dk.generate(model, "ROMEO:", GREEDY)
    assert len(completion.token_ids) == 24
    assert prefill(model, [IDS])[0].dtype == torch.float32


def test_a_compressed_model_on_the_device(tmp_path):
    """The GPU runs a compressed layer's float32 "unpack" maths (models/qlinear.py); the CPU's
    packed kernels round x to bfloat16 (int8pack, or any prefill above PACKED_MAX_ROWS rows),
    so the CPU reference is the same layers set to "unpack"."""
    from decodekit.compress import CompressConfig, compress_to_dir
    from decodekit.models.qlinear import set_kernels

    compress_to_dir("shakespeare", CompressConfig("rtn", bits=8), tmp_path / "int8")
    cpu = dk.load_model(tmp_path / "int8")
    set_kernels(cpu.net, "unpack")
    gpu = dk.load_model(tmp_path / "int8", device="cuda")
    torch.testing.assert_close(prefill(gpu, [IDS])[0].cpu(), prefill(cpu, [IDS])[0], rtol=1e-3, atol=1e-3)
    [completion] = dk.generate(gpu, "ROMEO:", GREEDY)
    assert len(completion.token_ids) == 24


@pytest.mark.parametrize("fused", [True, False], ids=["writing-sdpa", "written-out"])
def test_decode_steps_replayed_from_cuda_graphs_equal_the_eager_engine(pair, fused):
    """The engine's default on a GPU (engine/cuda_graphs.py): rows that end at different
    steps (padded buckets) and one past RunningKV's first 64 positions (captured again over
    the grown rows); the same greedy tokens as the eager engine, in both attention forms."""
    from decodekit.engine import Engine, EngineConfig
    from decodekit.engine.cuda_graphs import GraphedLanes

    _, gpu = pair
    prompts = ["ROMEO:", "JULIET: O Romeo, Romeo", "KING"]
    params = [GREEDY.replace(max_new_tokens=n) for n in (90, 9, 20)]
    out = {}
    for mode in (False, None):
        engine = Engine(gpu, EngineConfig(compile=mode))
        if mode is None:
            engine.compiled.lanes = engine.lanes = GraphedLanes(gpu, fused_attention=fused)
        handles = [engine.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
        while engine.has_work():
            engine.step()
        out[mode] = [h.result(0)[0].token_ids for h in handles]
    assert out[None] == out[False]
    lanes = engine.lanes
    assert isinstance(lanes, GraphedLanes) and lanes.failed is None
    assert lanes.captures >= 4 and engine.compiled.steps >= 85


def test_samples_read_their_shared_prompt_in_the_graphs_as_the_eager_engine(pair, monkeypatch):
    """n samples of a prompt keep it once on a GPU too (engine/rows.py `add_shared`; here at
    any size: `shares`' threshold at 0) and their graphed steps read it from the prefix
    buffer (engine/cuda_graphs.py); a second request's samples of a 93-token prompt join
    later (the buffer grows: the prefixed graphs captured again). Greedy, so every sample's
    tokens are the eager engine's and the CPU's."""
    from decodekit.engine import Engine, EngineConfig, rows

    monkeypatch.setattr(rows, "GPU_SHARE_MIN_BYTES", 0)
    cpu, gpu = pair
    long = "JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name. " * 3
    out = {}
    for model, mode in ((gpu, False), (gpu, None), (cpu, False)):
        engine = Engine(model, EngineConfig(compile=mode))
        handles = [engine.submit("ROMEO:", GREEDY.replace(n=3, max_new_tokens=40))]
        for _ in range(4):
            engine.step()
        assert sum(p is not None for p in engine.running_kv.prefixes) == 3
        handles.append(engine.submit(long, GREEDY.replace(n=2, max_new_tokens=12)))
        while engine.has_work():
            engine.step()
        out[model.device.type, mode] = [[c.token_ids for c in h.result(0)] for h in handles]
        if mode is None:
            lanes = engine.lanes
            assert lanes.failed is None and lanes.prefix_buffer[0].shape[3] >= 128
            assert any(prefixed for _, prefixed in lanes.graphs) and engine.compiled.steps >= 35
    assert out["cuda", None] == out["cuda", False] == out["cpu", False]


def test_a_decode_step_synchronises_the_host_at_most_twice(pair):
    """Counted by CUDA's sync debug mode (bench/engine.py `host_syncs_per_step`): the
    step's inputs go up asynchronously, and its tokens come down once."""
    from decodekit.bench.engine import engine_config, host_syncs_per_step

    _, gpu = pair
    counts = host_syncs_per_step(gpu, engine_config(None), steps=8)
    assert set(counts) == {"greedy", "top_p_4_samples_logprobs"}
    assert all(count <= 2 for count in counts.values()), counts


# Every strategy of tests/test_devices.py on the GPU. Greedy runs (and the compressed and
# GGUF models, whose CPU kernels round differently, see above: there the GPU's own second run)
# must equal the CPU's tokens; seeded ones must repeat themselves.
@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """Each model of test_devices.py `models`, on the CPU and on the GPU."""
    from decodekit.compress import CompressConfig, compress_to_dir
    from decodekit.meta.tasks.arith import load_orm, load_prm
    from decodekit.models.registry import ASSETS

    half_checkpoint = _test_devices().half_checkpoint
    path = tmp_path_factory.mktemp("cuda")
    compress_to_dir("shakespeare", CompressConfig("rtn", bits=8), path / "int8")
    compress_to_dir("shakespeare", CompressConfig("rtn", bits=4, group_size=32), path / "int4")
    compress_to_dir("shakespeare", CompressConfig("rtn", bits=4, head_bits=8), path / "int4-head8")
    where = {"shakespeare": "shakespeare", "draft": "shakespeare-draft", "arith": "arith",
             "int8": path / "int8", "int4": path / "int4", "int4-head8": path / "int4-head8",
             "half": half_checkpoint(path / "half"),
             "moe": _test_devices().moe_checkpoint(path / "moe")}  # fmt: skip
    try:
        from decodekit.compress.gguf import write_gguf

        where["gguf"] = write_gguf(ASSETS / "shakespeare", path / "s-q8_0.gguf", "q8_0")
    except ImportError:
        pass
    from decodekit.models.qlinear import set_kernels

    out = {}
    for device in ("cpu", "cuda"):
        out[device] = {key: dk.load_model(name, device=device) for key, name in where.items()}
        out[device]["orm"], out[device]["prm"] = load_orm("arith-hf-orm"), load_prm("arith-hf-prm")
    for key in ROUNDED:
        if key in out["cpu"]:
            set_kernels(out["cpu"][key].net, "unpack")  # the GPU's float32 maths (test above)
    return out


def _test_devices():
    """tests/test_devices.py, the strategies' runs and models."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import test_devices

    return test_devices


def _runs():
    """test_devices.py's RUNS, each skipped where its optional package is missing."""
    devices = _test_devices()

    def checked(name):
        def run(models):
            devices.skip_without_its_package(name)
            return devices.RUNS[name](models)

        return run

    return {name: checked(name) for name in devices.RUNS}


GREEDY_RUNS = ["greedy", "short-prompts-together", "stream", "beam", "speculative-draft",
               "speculative-self-int4", "contrastive", "contrastive-window", "constrained"]  # fmt: skip
ROUNDED = ["int8", "int4", "int4-head8", "gguf"]  # compressed: the CPU's packed kernels round x to bfloat16


@pytest.mark.parametrize("name", GREEDY_RUNS)
def test_greedy_strategies_on_the_device_give_the_cpus_tokens(both, name):
    run = _runs()[name]
    assert _test_devices().tokens(run(both["cuda"])) == _test_devices().tokens(run(both["cpu"]))


@pytest.mark.parametrize("name", sorted(set(_runs()) - set(GREEDY_RUNS)))
def test_seeded_strategies_on_the_device_repeat_themselves(both, name):
    run = _runs()[name]
    first = _test_devices().tokens(run(both["cuda"]))
    assert first == _test_devices().tokens(run(both["cuda"]))


@pytest.mark.parametrize("name", ROUNDED)
def test_compressed_models_on_the_device_give_the_cpus_unpack_tokens(both, name):
    if name not in both["cuda"]:
        pytest.skip("needs the gguf package")
    model = {"cpu": both["cpu"][name], "cuda": both["cuda"][name]}
    cpu, gpu = (dk.generate(model[d], ["ROMEO:", "JU"], GREEDY) for d in ("cpu", "cuda"))
    assert _test_devices().tokens(gpu) == _test_devices().tokens(cpu)
