"""Phi-3 and Phi-4-mini on decodekit's own forward, past LongRoPE's switch from its short to
its long factors, against transformers' Phi3ForCausalLM.

A tiny random model with Phi-4-mini's features: LongRoPE with a switch at 16 positions (its
original_max_position_embeddings) in a context of 64, 3/4 of each head rotated, tied
embeddings. LongRoPE rotates a sequence of L tokens with the long factors once L passes the
switch. A token decoded later is rotated by the length of its sequence then, and the keys
stored before keep their rotation: that is transformers' forward with a cache, token by token,
and what decodekit does (each row by its own length, as dynamic NTK: models/rope.py).
transformers' `generate` instead recomputes the whole cache once when a sequence crosses the
switch (Phi3ForCausalLM.prepare_inputs_for_generation), and llama.cpp picks one set for the
whole context at load: beyond the switch the three differ, within it they agree.
tests/models/test_native.py runs the plain-loop suite on Phi-3 and this model within the switch.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from tiny_weights import randomize, save_tiny

import decodekit as dk
from decodekit.engine import compiled
from decodekit.engine.config import EngineConfig
from decodekit.engine.engine import Engine
from decodekit.models.native import NativeLM
from decodekit.models.registry import load_model

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)  # fmt: skip
SWITCH = 16
ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.1 * i for i in range(6)], "long_factor": [1.0 + 2.0 * i for i in range(6)]}
PROMPTS = [[5, 17, 3, 99, 42, 8, 8, 61, 2, 30], [7, 1, 88, 14, 64, 9, 0, 12, 77, 3, 50, 6, 6, 1]]
NEW_TOKENS = 20
TOL = 1e-4

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def phi(tmp_path_factory):
    path = tmp_path_factory.mktemp("phi4-mini")
    config = transformers.Phi3Config(**TINY, original_max_position_embeddings=SWITCH,
                                     rope_parameters=dict(ROPE), tie_word_embeddings=True, pad_token_id=0,
                                     eos_token_id=None, bos_token_id=None)  # fmt: skip
    config._attn_implementation = "eager"
    hf_model = save_tiny(config, path)
    model = load_model(path)
    assert isinstance(model, NativeLM)
    return hf_model, model, path


def hf_stepwise(hf_model, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens through its forward with a cache, token by token, and the
    logits [new_tokens, V] each chose from."""
    tokens, logits = [], []
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt]), use_cache=True)
        for _ in range(new_tokens):
            logits.append(out.logits[0, -1].float())
            tokens.append(int(logits[-1].argmax()))
            out = hf_model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
    return tokens, torch.stack(logits)


def test_the_rope_is_longrope_with_a_partial_rotation(phi):
    _, model, _ = phi
    rope = model.config.rope
    assert (rope.kind, rope.head_dim, rope.threshold) == ("longrope", 12, SWITCH)
    import math

    # transformers' default: sqrt(1 + ln(factor) / ln(original)), factor = 64 / 16
    assert rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(16)))


@pytest.mark.parametrize("length", [SWITCH, SWITCH + 1, 40])
def test_a_whole_sequence_gives_transformers_logits_on_either_side_of_the_switch(phi, length):
    hf_model, model, _ = phi
    tokens = torch.tensor([[(7 * i + 3) % 97 for i in range(length)]])
    with torch.no_grad():
        expected = hf_model(tokens).logits[0].float()
    assert (model.forward(tokens, model.new_cache(1))[0] - expected).abs().max() <= TOL


def test_decoding_across_the_switch_is_transformers_forward_with_a_cache(phi):
    """The plain loop and the engine, each row crossing at its own step, alone and batched: the
    greedy tokens and logits of transformers' cached forward. Its `generate` recomputes the
    cache at the crossing (module docstring) and so differs after it, and agrees before."""
    hf_model, model, _ = phi
    greedy = dk.SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    batched = dk.generate(model, PROMPTS, greedy)
    recomputed = []  # whether transformers' generate, recomputing its cache, differs past the switch
    for prompt, [completion] in zip(PROMPTS, batched):
        want, logits = hf_stepwise(hf_model, prompt, NEW_TOKENS)
        assert completion.token_ids == want
        chosen = torch.log_softmax(logits, -1).gather(-1, torch.tensor(want)[:, None])[:, 0]
        assert completion.logprobs == pytest.approx(chosen.tolist(), abs=TOL)
        [[alone]] = dk.generate(model, [prompt], greedy)
        assert alone.token_ids == want
        with torch.no_grad():
            ones = torch.ones((1, len(prompt)), dtype=torch.long)  # token 0 is not padding here
            generated = hf_model.generate(torch.tensor([prompt]), attention_mask=ones,
                                          max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                          pad_token_id=0)[0, len(prompt) :].tolist()  # fmt: skip
        within = SWITCH - len(prompt)  # the tokens decoded before the sequence passes the switch
        assert generated[:within] == want[:within]
        recomputed.append(generated != want)
    assert any(recomputed)
    cache = model.new_cache(1)  # the plain loop
    logits = model.forward(torch.tensor([PROMPTS[0]]), cache)[0, -1]
    for token in hf_stepwise(hf_model, PROMPTS[0], NEW_TOKENS)[0]:
        assert int(logits.argmax()) == token
        logits = model.forward(torch.tensor([[token]]), cache)[0, -1]


def test_the_compiled_step_runs_below_the_switch_and_eager_past_it(phi, monkeypatch):
    """The compiled step holds the short tables: rows below the switch decode through it, a
    step with a row past it runs eager; greedy and seeded tokens as the eager engine's."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    _, base, _ = phi
    greedy = dk.SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    seeded = dk.SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, seed=3, n=2, ignore_eos=True)

    def run(mode: bool) -> tuple[list, Engine, int]:
        model = NativeLM(base.net, base.config, tokenizer=base.tokenizer)  # no compiled steps yet
        engine = Engine(model, EngineConfig(compile=mode, block_size=4, num_blocks=256))
        handles = [engine.submit(PROMPTS[0], greedy), engine.submit(PROMPTS[1][:4], seeded)]
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
        return [[c.token_ids for c in h.result(0)] for h in handles], engine, steps

    want, _, _ = run(False)
    got, engine, steps = run(True)
    assert got == want
    # decode steps below the switch compiled (the first row passes it 6 tokens in), the rest eager
    assert 0 < engine.compiled.steps < steps


def test_speculation_refuses_a_prompt_past_the_switch(phi):
    _, model, _ = phi
    long_prompt = [(3 * i) % 101 for i in range(SWITCH + 2)]
    params = dk.SamplingParams(temperature=0, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"a longrope-RoPE model's 16 trained positions; this prompt has 18"):
        dk.speculative_generate(model, model, [long_prompt], params)
    longer = params.replace(max_new_tokens=20)  # a short prompt speculates past the switch, exactly
    short = dk.speculative_generate(model, model, [long_prompt[:6]], longer)
    assert short.completions[0][0].token_ids == dk.generate(model, [long_prompt[:6]], longer)[0][0].token_ids


def test_phi3s_older_name_of_longrope(phi, tmp_path):
    """Phi-3's configs on the Hub name LongRoPE "su" (transformers reads it as longrope)."""
    _, model, path = phi
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "su"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    assert load_model(tmp_path).config.rope == model.config.rope


def test_a_gguf_file_of_phi3_gives_the_checkpoints_logits(tmp_path, tiny_llama_dir):
    """`write_gguf` stores Phi-3 as llama.cpp's converter does (q/k/v and gate/up fused as
    attn_qkv and ffn_up, the rotated dims, LongRoPE's factors as tensors, its switch and
    attention factor as keys) and `load_model` reads back the checkpoint's model: the same
    config but the attention factor's float32 rounding, transformers' logits within and past
    the switch. llama.cpp reads these files: tests/models/test_gguf_peer.py."""
    pytest.importorskip("gguf")
    import shutil

    from decodekit.compress.gguf import write_gguf

    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    config = transformers.Phi3Config(**{**TINY, "vocab_size": vocab}, original_max_position_embeddings=SWITCH,
                                     rope_parameters=dict(ROPE), tie_word_embeddings=True, pad_token_id=0,
                                     eos_token_id=None, bos_token_id=None)  # fmt: skip
    hf_model = transformers.Phi3ForCausalLM(config)
    randomize(hf_model)
    hf_model.save_pretrained(tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_dir / name, tmp_path / "hf" / name)
    model = load_model(write_gguf(tmp_path / "hf", tmp_path / "phi3.gguf"))
    reference = load_model(tmp_path / "hf")
    factor = reference.config.rope.attention_factor
    assert model.config.rope.attention_factor == pytest.approx(factor, rel=1e-7)
    assert model.config.layer_windows == () and model.config.rope.head_dim == 12
    for length in (12, 40):  # within the switch and past it
        tokens = torch.tensor([[(7 * i + 3) % 97 for i in range(length)]])
        with torch.no_grad():
            expected = hf_model.eval()(tokens).logits[0].float()
        assert (model.forward(tokens, model.new_cache(1))[0] - expected).abs().max() <= TOL
