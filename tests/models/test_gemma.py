"""Gemma 3 (and Gemma 1 and 2) on decodekit's own forward, against transformers' Gemma3ForCausalLM.

A tiny random Gemma 3 with every difference from Llama switched on: (1 + w) RMSNorms (folded
into the weights at load), an embedding scaled by sqrt(hidden), GeGLU, four norms a block,
q/k norms, three sliding layers of window 6 with their own RoPE base beside a full layer
with linear scaling, queries scaled by query_pre_attn_scalar, capped logits. Its sequences run
past 5 windows. tests/models/test_native.py runs the plain-loop suite (batches, padding, fork,
crop, bfloat16) on Gemma 1 and 3 beside the other families; here: that each difference shows
in the logits and is computed, the paged engine and its compiled step, the old config layout,
Gemma 2's capped attention scores on every path, what NativeLM refuses, compression and GGUF.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from tiny_weights import hf_greedy, hf_logits, randomize, save_tiny

import decodekit as dk
from decodekit.compress.pretrained import save_compressed_dir
from decodekit.compress.recipe import CompressConfig, compress_lm
from decodekit.engine import compiled
from decodekit.engine.config import EngineConfig
from decodekit.engine.engine import Engine
from decodekit.models.native import NativeLM
from decodekit.models.registry import load_model

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
WINDOW = 6
LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}  # fmt: skip
PROMPTS = [[5, 17, 3, 99, 42, 8], [7, 1, 88, 14, 64, 9, 0, 12, 77, 3, 50, 6, 6, 1, 2, 3, 4, 5, 9, 21]]
NEW_TOKENS = 24
TOL = 1e-4
GEMMA_NORMS = {"norm_center": 0.0, "norm_spread": 0.2}  # Gemma's (1 + w) norms: weights around 0

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def gemma3_config(vocab_size: int, **changes) -> transformers.Gemma3TextConfig:
    fields = dict(**TINY, vocab_size=vocab_size, head_dim=32, sliding_window=WINDOW, layer_types=LAYERS,
                  query_pre_attn_scalar=20, final_logit_softcapping=12.0, rope_parameters=copy.deepcopy(ROPE),
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)  # fmt: skip
    fields.update(changes)
    config = transformers.Gemma3TextConfig(**fields)
    config._attn_implementation = "eager"
    return config


def save(config, path, tokenizer_dir=None) -> transformers.PreTrainedModel:
    return save_tiny(config, path, tokenizer_dir, **GEMMA_NORMS)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, tiny_llama_dir):
    """(transformers model, decodekit model) of one tiny random Gemma 3, with the tiny Llama's
    tokenizer (so it takes text: compression's calibration, `generate` of a string)."""
    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    path = tmp_path_factory.mktemp("gemma3")
    hf_model = save(gemma3_config(vocab), path, tiny_llama_dir)
    model = load_model(path)
    assert isinstance(model, NativeLM)
    return hf_model, model


SEQUENCE = [(7 * i + 3) % 97 for i in range(40)]


@pytest.mark.parametrize("change", [
    {"query_pre_attn_scalar": 32},  # = head_dim: the plain scale
    {"rope_parameters": {**ROPE, "sliding_attention": ROPE["full_attention"]}},  # one RoPE for every layer
    {"final_logit_softcapping": None},
    {"layer_types": ["full_attention"] * 4},  # no window
    {"hidden_activation": "gelu"},  # exact GELU, not its tanh approximation
])  # fmt: skip
def test_each_difference_shows_in_the_logits_and_is_computed(gemma3, tmp_path, change):
    """A model that differs from the fixture's in one setting, same weights: transformers'
    logits move (so the fixture's test exercises that setting) and NativeLM's follow."""
    hf_model, model = gemma3
    changed = transformers.AutoModelForCausalLM.from_config(gemma3_config(model.vocab_size, **change))
    changed.load_state_dict(hf_model.state_dict())
    changed.eval().save_pretrained(tmp_path)
    expected, base = hf_logits(changed, SEQUENCE), hf_logits(hf_model, SEQUENCE)
    assert (expected - base).abs().max() > 1e-3
    assert (model.forward(torch.tensor([SEQUENCE]), model.new_cache(1))[0] - base).abs().max() <= TOL
    other = load_model(tmp_path)
    assert (other.forward(torch.tensor([SEQUENCE]), other.new_cache(1))[0] - expected).abs().max() <= TOL


def test_norm_weights_are_stored_shifted_as_llama_cpp_stores_them(gemma3):
    hf_model, model = gemma3
    theirs = hf_model.model.layers[1].pre_feedforward_layernorm.weight
    ours = model.net.layers[1].pre_feedforward_layernorm.weight
    assert torch.equal(ours, theirs.float() + 1)
    q_norm = hf_model.model.layers[0].self_attn.q_norm.weight
    assert torch.equal(model.net.layers[0].self_attn.q_norm.weight, q_norm + 1)
    assert model.config.layer_windows == (WINDOW, WINDOW, None, WINDOW)
    assert model.config.embed_scale == 8.0 and model.config.activation == "gelu_pytorch_tanh"


def test_a_bfloat16_model_keeps_its_shifted_norms_in_float32(gemma3, tmp_path, tiny_llama_dir):
    """(1 + w) rounded to bfloat16 loses w's low bits (1.01 -> 1.0078); transformers keeps w in
    the checkpoint's dtype and adds 1 in float32. So a half model keeps its shifted norms in
    float32 (from a checkpoint and from a GGUF file), and normalises and scales in float32,
    rounding once: transformers' Gemma3RMSNorm to a bfloat16 rounding."""
    hf_model, float_model = gemma3
    hf_model.save_pretrained(tmp_path)
    model = NativeLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    ours = model.net.layers[1].post_feedforward_layernorm
    float_norm = float_model.net.layers[1].post_feedforward_layernorm
    assert ours.weight.dtype == torch.float32 and torch.equal(ours.weight, float_norm.weight)
    assert model.net.layers[1].mlp.down_proj.weight.dtype == torch.bfloat16
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = theirs.model.layers[1].post_feedforward_layernorm(x)
        got = ours(x)
    assert got.dtype == torch.bfloat16
    assert (got.float() - expected.float()).abs().max() <= 2**-7 * expected.float().abs().max()
    pytest.importorskip("gguf")
    from decodekit.compress.gguf import write_gguf

    save(gemma3_config(model.vocab_size, query_pre_attn_scalar=32), tmp_path / "g", tiny_llama_dir)
    from_file = load_model(write_gguf(tmp_path / "g", tmp_path / "g.gguf", "f16"), dtype="bfloat16")
    norms = {p.dtype for n, p in from_file.net.named_parameters() if n.endswith("norm.weight")}
    assert norms == {torch.float32}


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_engine_generates_past_the_windows_like_transformers(gemma3, batch_invariant):
    hf_model, base = gemma3
    model = NativeLM(base.net, base.config, batch_invariant=batch_invariant)
    greedy = dk.SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    sampled = dk.SamplingParams(max_new_tokens=NEW_TOKENS, seed=1, n=3, ignore_eos=True)
    got = dk.generate(model, PROMPTS + [PROMPTS[1]], [greedy, greedy, sampled])  # the engine
    for prompt, [completion] in zip(PROMPTS, got[:2]):
        assert completion.token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS)
    for prompt, completions in zip(PROMPTS, got):  # every row's log-probs are transformers'
        for completion in completions:
            sequence = prompt + completion.token_ids
            logits = hf_logits(hf_model, sequence)[len(prompt) - 1 : -1]
            chosen = torch.tensor(completion.token_ids)[:, None]
            expected = torch.log_softmax(logits, -1).gather(-1, chosen)[:, 0]
            assert completion.logprobs == pytest.approx(expected.tolist(), abs=TOL)
    assert len({tuple(c.token_ids) for c in got[2]}) > 1  # the samples differ


def test_the_compiled_step_gives_the_eager_engines_tokens(gemma3, monkeypatch):
    """The compiled decode step (engine/compiled.py: the same modules traced, each layer's half
    of the rotary tables indexed inside the graph): greedy and seeded rows as eager."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    _, base = gemma3
    seeded = dk.SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16, seed=5, n=3,
                               ignore_eos=True)
    greedy = dk.SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)

    def run(mode: bool) -> tuple[list, Engine]:
        model = NativeLM(base.net, base.config, tokenizer=base.tokenizer)  # no compiled steps yet
        engine = Engine(model, EngineConfig(compile=mode, block_size=4, num_blocks=256))
        handles = [engine.submit(PROMPTS[0], greedy), engine.submit(PROMPTS[1], seeded)]
        while engine.has_work():
            engine.step()
        return [[c.token_ids for c in h.result(0)] for h in handles], engine

    want, _ = run(False)
    got, engine = run(True)
    assert got == want and engine.compiled.steps > 0


@pytest.mark.parametrize("fused", [True, False], ids=["writing-sdpa", "written-out"])
def test_the_cuda_graphs_step_masks_each_window_as_the_eager_engine(gemma3, fused):
    """The CUDA graphs' step (engine/cuda_graphs.py), run on the CPU without capture as in
    tests/engine/test_cuda_graphs.py: each row attends over its whole capacity, its sliding
    layers' columns before the window masked, in both attention forms: tokens as eager."""
    from decodekit.engine.cuda_graphs import GraphedLanes

    _, base = gemma3
    greedy = dk.SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    sampled = dk.SamplingParams(temperature=1.0, top_k=20, seed=3, max_new_tokens=9)

    def run(graphed: bool) -> list:
        model = NativeLM(base.net, base.config, tokenizer=base.tokenizer)
        engine = Engine(model, EngineConfig(compile=graphed or False, block_size=4, num_blocks=256))
        if graphed:
            engine.compiled.lanes = engine.lanes = GraphedLanes(model, capture=False, fused_attention=fused)
        handles = [engine.submit(PROMPTS[0], greedy), engine.submit(PROMPTS[1], sampled)]
        while engine.has_work():
            engine.step()
        assert not graphed or engine.compiled.steps > 0
        return [[c.token_ids for c in h.result(0)] for h in handles]

    assert run(True) == run(False)


def test_the_old_config_layout_loads_the_same_model(gemma3, tmp_path):
    """Gemma 3 configs on the Hub predate layer_types and per-type rope_parameters: rope_theta,
    rope_local_base_freq, rope_scaling and sliding_window_pattern say the same."""
    hf_model, model = gemma3
    save(gemma3_config(model.vocab_size), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
        config.pop(key, None)
    config.update(rope_theta=10000.0, rope_local_base_freq=50.0, sliding_window_pattern=3,
                  rope_scaling={"rope_type": "linear", "factor": 2.0})  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    old = load_model(tmp_path)
    assert old.config == model.config
    assert old.max_context == 64  # max_position_embeddings is Gemma 3's context, scaled or not
    tokens = torch.tensor([SEQUENCE])
    assert torch.equal(old.forward(tokens, old.new_cache(1)), model.forward(tokens, model.new_cache(1)))


def gemma2_model(tmp_path, cap: float | None = 2.0):
    """A tiny random Gemma 2: every other layer slides (window 6), scores capped at `cap`."""
    config = transformers.Gemma2Config(**TINY, vocab_size=101, head_dim=32, sliding_window=WINDOW,
                                       query_pre_attn_scalar=20, attn_logit_softcapping=cap,
                                       final_logit_softcapping=12.0, eos_token_id=None, bos_token_id=None,
                                       pad_token_id=None)  # fmt: skip
    config._attn_implementation = "eager"  # transformers' SDPA cannot cap scores
    hf_model = transformers.Gemma2ForCausalLM(config)
    randomize(hf_model, **GEMMA_NORMS)
    hf_model.save_pretrained(tmp_path)
    return hf_model.eval(), load_model(tmp_path)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_gemma2s_capped_scores_on_the_engine_like_transformers(tmp_path, batch_invariant):
    """Gemma 2 caps every attention score (cap * tanh(s / cap)), which the fused kernels cannot:
    every attention path takes its written-out form then (models/attention.py). The cap moves
    transformers' logits, and the engine's greedy tokens and log-probs past the windows are
    transformers', alone per query (batch-invariant) or not."""
    hf_model, base = gemma2_model(tmp_path)
    assert base.config.attn_softcap == 2.0 and base.config.layer_windows == (WINDOW, None, WINDOW, None)
    uncapped = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **{**hf_model.config.to_dict(), "attn_logit_softcapping": None}))  # fmt: skip
    uncapped.load_state_dict(hf_model.state_dict())
    assert (hf_logits(uncapped.eval(), SEQUENCE) - hf_logits(hf_model, SEQUENCE)).abs().max() > 0.1
    model = NativeLM(base.net, base.config, batch_invariant=batch_invariant)
    greedy = dk.SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt, [completion] in zip(PROMPTS, dk.generate(model, PROMPTS, greedy)):
        assert completion.token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS)
        logits = hf_logits(hf_model, prompt + completion.token_ids)[len(prompt) - 1 : -1]
        chosen = torch.tensor(completion.token_ids)[:, None]
        expected = torch.log_softmax(logits, -1).gather(-1, chosen)[:, 0]
        assert completion.logprobs == pytest.approx(expected.tolist(), abs=TOL)


def test_gemma2s_compiled_and_graphed_steps_cap_as_the_eager_engine(tmp_path, monkeypatch):
    from decodekit.engine.cuda_graphs import GraphedLanes

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    _, base = gemma2_model(tmp_path)
    greedy = dk.SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    seeded = dk.SamplingParams(temperature=1.0, max_new_tokens=16, seed=5, n=2, ignore_eos=True)

    def run(mode: str) -> list:
        model = NativeLM(base.net, base.config)
        engine = Engine(model, EngineConfig(compile=mode != "eager", block_size=4, num_blocks=256))
        if mode in ("writing-sdpa", "written-out"):
            lanes = GraphedLanes(model, capture=False, fused_attention=mode == "writing-sdpa")
            engine.compiled.lanes = engine.lanes = lanes
        handles = [engine.submit(PROMPTS[0], greedy), engine.submit(PROMPTS[1], seeded)]
        while engine.has_work():
            engine.step()
        assert mode == "eager" or engine.compiled.steps > 0
        return [[c.token_ids for c in h.result(0)] for h in handles]

    want = run("eager")
    for mode in ("compiled", "writing-sdpa", "written-out"):
        assert run(mode) == want, mode


def test_what_nativelm_cannot_run_is_named(tmp_path):
    from decodekit.models.native_config import unsupported_reason

    bidirectional = {**gemma3_config(101).to_dict(), "use_bidirectional_attention": True}
    reason = "use_bidirectional_attention must be false: NativeLM's attention is causal"
    assert unsupported_reason(bidirectional) == reason


def test_a_compressed_gemma_round_trips_its_shifted_norms(gemma3, tmp_path, tiny_llama_dir):
    """int8 RTN in memory, saved and loaded: the same logits (the norms are saved shifted and
    not shifted again), near the float model's, and the engine's greedy tokens are the same."""
    _, base = gemma3
    source = tmp_path / "source"
    save(gemma3_config(base.vocab_size), source, tiny_llama_dir)
    model = load_model(source)
    summary = compress_lm(model, CompressConfig("rtn", bits=8), SEQUENCE * 4)
    loaded = load_model(save_compressed_dir(model, tmp_path / "c", source, summary))
    tokens = torch.tensor([SEQUENCE])
    expected = model.forward(tokens, model.new_cache(1))
    assert torch.equal(loaded.forward(tokens, loaded.new_cache(1)), expected)
    # int8's error at this tiny random shape: 0.16 of logits up to ~5 (a Qwen3 of it: 0.16 too)
    assert (expected - base.forward(tokens, base.new_cache(1))).abs().max() < 0.3
    params = dk.SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    [before], [after] = dk.generate(model, "ROMEO:", params), dk.generate(loaded, "ROMEO:", params)
    assert before.token_ids == after.token_ids


@pytest.mark.parametrize("family", ["gemma3", "gemma2", "gemma"])
def test_a_gguf_file_of_gemma_gives_the_checkpoints_logits(family, tmp_path, tiny_llama_dir):
    """`write_gguf` stores Gemma as llama.cpp's converter does (norms shifted, gemma3's window,
    sliding flags, their RoPE base and the logits' cap as keys, the post norms under their
    names), and `load_model` of the file reads back the checkpoint's model: transformers'
    logits from the f32 file, near them from q8_0."""
    pytest.importorskip("gguf")
    from decodekit.compress.gguf import write_gguf

    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    configs = {  # query_pre_attn_scalar as llama.cpp derives it: head_dim
        "gemma3": lambda: gemma3_config(vocab, query_pre_attn_scalar=32),
        "gemma2": lambda: transformers.Gemma2Config(
            **TINY, vocab_size=vocab, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=32,
            attn_logit_softcapping=2.0, final_logit_softcapping=12.0, attn_implementation="eager"),
        "gemma": lambda: transformers.GemmaConfig(**TINY, vocab_size=vocab, head_dim=32),
    }
    config = configs[family]()
    hf_model = save(config, tmp_path / "hf", tiny_llama_dir)
    expected = hf_logits(hf_model, SEQUENCE)
    for kind, tolerance in (("f32", TOL), ("q8_0", 0.3)):
        model = load_model(write_gguf(tmp_path / "hf", tmp_path / f"{kind}.gguf", kind))
        assert model.config == load_model(tmp_path / "hf").config
        got = model.forward(torch.tensor([SEQUENCE]), model.new_cache(1))[0]
        assert (got - expected).abs().max() <= tolerance


def test_gguf_writing_refuses_what_llama_cpps_gemma3_cannot_hold(gemma3, tmp_path):
    pytest.importorskip("gguf")
    from decodekit.compress.gguf import write_gguf

    save(gemma3_config(101), tmp_path)  # query_pre_attn_scalar 20, head_dim 32
    with pytest.raises(ValueError, match=r"llama.cpp's gemma3 scales queries by 1 / sqrt\(32\)"):
        write_gguf(tmp_path, tmp_path / "g.gguf")
