"""Sliding-window models generate past their window, attending to the last `sliding_window`
positions, as transformers' MistralForCausalLM does; positions past the context raise.

A tiny random Mistral (window 16, 64 positions) is saved as a checkpoint directory and
loaded through `load_model`; its sequences run to 40-48 positions, so most queries see
only part of what came before. Both of decodekit's paths are compared with transformers
over the whole sequence: the plain loop (NativeLM.forward on a contiguous cache,
left-padded batches included) and the paged engine that `generate` uses.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_weights import randomize, save_tiny

import decodekit as dk
from decodekit.decode.sample import _steps
from decodekit.models.native import NativeLM
from decodekit.models.registry import load_model
from decodekit.request import emit, make_requests

WINDOW = 16
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)  # fmt: skip
PROMPTS = [[5, 17, 3, 99, 42, 8], [7, 1, 88, 14, 64, 9, 0, 12, 77, 3, 50, 6, 6, 1, 2, 3, 4, 5, 9, 21]]
NEW_TOKENS = 28  # prompt + new > 2 x WINDOW
TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(transformers model, decodekit model) of one tiny random sliding-window Mistral."""
    path = tmp_path_factory.mktemp("mistral-sliding")
    config = transformers.MistralConfig(**TINY, sliding_window=WINDOW, eos_token_id=None,
                                        bos_token_id=None, pad_token_id=None)  # fmt: skip
    config._attn_implementation = "eager"
    hf_model = save_tiny(config, path)
    model = load_model(path)
    assert isinstance(model, NativeLM) and model.max_context == 64
    return hf_model, model


def hf_greedy(hf_model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens, and its logits [T, V] over the whole final sequence."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        logits = hf_model(out).logits[0].float()  # [T, V]
    return out[0, len(prompt) :].tolist(), logits


def test_window_reaches_past_it_and_sees_only_the_window(mistral):
    hf_model, model = mistral
    tokens = [(7 * i + 3) % 101 for i in range(40)]
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]
        full = transformers.MistralForCausalLM(hf_model.config.__class__(
            **{**hf_model.config.to_dict(), "sliding_window": None}))  # fmt: skip
        full.load_state_dict(hf_model.state_dict())
        unwindowed = full.eval()(torch.tensor([tokens])).logits[0]
    # The window matters from position 16 on: full attention gives other logits there.
    assert (expected[:WINDOW] - unwindowed[:WINDOW]).abs().max() <= TOL
    assert (expected[WINDOW:] - unwindowed[WINDOW:]).abs().max() > 0.1
    got = model.forward(torch.tensor([tokens]), model.new_cache(1))[0]
    assert (got - expected).abs().max() <= TOL


def test_plain_path_decodes_past_the_window_like_transformers(mistral):
    hf_model, model = mistral
    for prompt in PROMPTS:
        want, hf_logits = hf_greedy(hf_model, prompt)
        cache = model.new_cache(1)
        logits = [model.forward(torch.tensor([prompt]), cache)[0]]  # [P, V]
        got = []
        for _ in range(NEW_TOKENS):
            got.append(int(logits[-1][-1].argmax()))
            logits.append(model.forward(torch.tensor([[got[-1]]]), cache)[0])
        assert got == want
        assert (torch.cat(logits)[:-1] - hf_logits[:-1]).abs().max() <= TOL


def test_plain_loop_with_left_padding_matches_transformers(mistral):
    """generate's loop for non-engine models: prompts of different lengths, left-padded."""
    hf_model, model = mistral
    params = dk.SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    requests = make_requests(model, PROMPTS, params)
    out = {}
    for rows in _steps(model, requests):
        for delta in emit(rows, model.max_context):
            if delta.completion is not None:
                out[delta.prompt_index] = delta.completion.token_ids
    assert [out[0], out[1]] == [hf_greedy(hf_model, p)[0] for p in PROMPTS]


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_engine_generates_past_the_window_like_transformers(mistral, batch_invariant):
    hf_model, base = mistral
    model = NativeLM(base.net, base.config, batch_invariant=batch_invariant)
    greedy = dk.SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    sampled = dk.SamplingParams(max_new_tokens=NEW_TOKENS, seed=1, n=3, ignore_eos=True)
    got = dk.generate(model, PROMPTS + [PROMPTS[0]], [greedy, greedy, sampled])  # the engine
    for prompt, [completion] in zip(PROMPTS, got[:2]):
        want, hf_logits = hf_greedy(hf_model, prompt)
        assert completion.token_ids == want and completion.finish_reason == "length"
        chosen = torch.log_softmax(hf_logits[len(prompt) - 1 : -1], dim=-1)
        chosen = chosen.gather(-1, torch.tensor(want)[:, None])[:, 0]
        assert completion.logprobs == pytest.approx(chosen.tolist(), abs=TOL)
    # Samples forked from one prompt: each equals transformers over its own sequence.
    for completion in got[2]:
        sequence = PROMPTS[0] + completion.token_ids
        with torch.no_grad():
            hf_logits = hf_model(torch.tensor([sequence])).logits[0, len(PROMPTS[0]) - 1 : -1]
        expected = torch.log_softmax(hf_logits, -1).gather(-1, torch.tensor(completion.token_ids)[:, None])
        assert completion.logprobs == pytest.approx(expected[:, 0].tolist(), abs=TOL)


def test_positions_past_max_position_embeddings_raise(mistral):
    _, model = mistral
    cache = model.new_cache(1)
    model.forward(torch.zeros((1, 60), dtype=torch.long), cache)
    with pytest.raises(ValueError, match=r"position 64 .* context of 64 .*max_position_embeddings=64"):
        model.forward(torch.zeros((1, 5), dtype=torch.long), cache)
    assert cache.length == 60  # nothing was appended
    model.forward(torch.zeros((1, 4), dtype=torch.long), cache)  # positions 60..63 fit
    with pytest.raises(ValueError, match="prompt has 64 tokens; the model's context is 64"):
        dk.generate(model, [[1] * 64], dk.SamplingParams(max_new_tokens=2))


def test_rope_scaling_extends_the_context(tmp_path):
    config = transformers.LlamaConfig(
        **TINY, rope_scaling={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.max_context == 128  # 64 x 2: linear scaling leaves max_position_embeddings
    model.forward(torch.zeros((1, 128), dtype=torch.long), model.new_cache(1))
    with pytest.raises(ValueError, match=r"position 128 .*128 positions .*=64, times the linear"):
        model.forward(torch.zeros((1, 129), dtype=torch.long), model.new_cache(1))


def test_qwen2_slides_only_its_upper_layers(tmp_path):
    """Qwen2: layers from max_window_layers on slide, the ones below attend fully."""
    config = transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=WINDOW,
                                      max_window_layers=1)  # fmt: skip
    assert config.layer_types == ["full_attention", "sliding_attention"]
    config._attn_implementation = "eager"
    hf_model = transformers.Qwen2ForCausalLM(config)
    randomize(hf_model)
    hf_model.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.config.layer_windows == (None, WINDOW)
    prompt = PROMPTS[1]
    want, hf_logits = hf_greedy(hf_model.eval(), prompt)
    got = model.forward(torch.tensor([prompt + want]), model.new_cache(1))[0]
    assert (got[:-1] - hf_logits[:-1]).abs().max() <= TOL
    greedy = dk.SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    [completion] = dk.generate(model, [prompt, PROMPTS[0]], greedy)[0]  # the engine
    assert completion.token_ids == want
