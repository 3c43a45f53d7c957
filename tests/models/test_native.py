"""NativeLM against transformers on tiny random checkpoints of each supported family.

Weights are re-drawn large enough (std 0.15, norm weights and biases away from their
1 / 0 initialisation) that attention is far from uniform: a wrong rotation, bias, norm
or mask changes the logits by far more than the 1e-4 tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from tiny_weights import randomize

from decodekit.models.base import left_pad, prefill
from decodekit.models.contiguous_kv import ContiguousKVCache
from decodekit.models.native import NativeLM

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=101,
    max_position_embeddings=64,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=False),
    "llama-tied": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=True),
    "llama-mha": lambda: transformers.LlamaConfig(**{**TINY, "num_key_value_heads": 4}),
    "llama-bias": lambda: transformers.LlamaConfig(**TINY, attention_bias=True, mlp_bias=True),
    "llama3-rope": lambda: transformers.LlamaConfig(**TINY, rope_scaling=LLAMA3_ROPE),
    "linear-rope": lambda: transformers.LlamaConfig(
        **TINY, rope_scaling={"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}
    ),
    "mistral": lambda: transformers.MistralConfig(**TINY, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=32),  # head_dim != 64 / 4
    # fused qkv_proj and gate_up_proj in the checkpoint; every layer slides
    "phi3": lambda: transformers.Phi3Config(**TINY, sliding_window=6, pad_token_id=0),
    # LongRoPE (its short factors: these sequences stay within 48 positions), 3/4 of each head
    # rotated, tied: Phi-4-mini's features (tests/models/test_phi3.py: past the 48)
    "phi4-mini": lambda: transformers.Phi3Config(
        **TINY, original_max_position_embeddings=48, pad_token_id=0, tie_word_embeddings=True,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "short_factor": [1.0 + 0.1 * i for i in range(6)],
                         "long_factor": [1.0 + 2.0 * i for i in range(6)]}),
    # attention scores capped (tests/models/test_gemma.py: past its windows, the engine)
    "gemma2": lambda: transformers.Gemma2Config(
        **TINY, head_dim=32, sliding_window=4, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
        final_logit_softcapping=8.0),
    # GeGLU, (1 + w) norms, a scaled embedding; Gemma 1's legacy "gelu" is the tanh GELU
    "gemma": lambda: transformers.GemmaConfig(**TINY, head_dim=32, hidden_act="gelu"),
    # sandwich norms, q/k norms, one sliding layer with its own RoPE base, queries scaled by
    # query_pre_attn_scalar, capped logits (tests/models/test_gemma.py: the rest)
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **TINY, head_dim=32, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=24, final_logit_softcapping=8.0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
    # mixtures of experts (models/feedforward.py): Mixtral's renormalised top 2 of 4 (its
    # checkpoint names w1/w2/w3); Qwen3-MoE's top 3 of 5 without renormalising, and an MLP in
    # its mlp_only_layers; Qwen2-MoE's sigmoid-gated shared expert, experts every 2nd layer
    "mixtral": lambda: transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2),
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(
        **TINY, head_dim=32, num_experts=5, num_experts_per_tok=3, moe_intermediate_size=40,
        norm_topk_prob=False, mlp_only_layers=[1]),
    "qwen2-moe": lambda: transformers.Qwen2MoeConfig(
        **TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True,
        shared_expert_intermediate_size=56, decoder_sparse_step=2),
    # AI2's: OLMo 2's post-norm blocks and q/k norms over the whole projection; OLMoE's mixture
    "olmo2": lambda: transformers.Olmo2Config(**TINY),
    "olmoe": lambda: transformers.OlmoeConfig(**TINY, num_experts=5, num_experts_per_tok=2),
}
PROMPTS = [[5, 17, 3, 99, 42, 8, 8, 61, 2, 30], [7, 1, 88, 14], [64, 9, 0, 12, 77, 3, 50]]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def save_family(family: str, path) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family]())
    randomize(model, seed=len(family))
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_family(request.param, path)
    return hf_model, NativeLM.from_pretrained(path)


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()  # [T, V]


def native_logits(model: NativeLM, tokens: list[int]) -> torch.Tensor:
    return model.forward(torch.tensor([tokens]), model.new_cache(1))[0]  # [T, V]


def test_logits_equal_transformers_on_a_batch(pair):
    hf_model, model = pair
    tokens = torch.tensor([PROMPTS[0], PROMPTS[0][::-1], [3] * 10])
    with torch.no_grad():
        expected = hf_model(tokens).logits.float()  # [B, T, V]
    got = model.forward(tokens, model.new_cache(3))
    assert got.dtype == torch.float32 and got.shape == (3, 10, 101)
    assert expected.abs().max() > 1.0  # the comparison is not between near-zero logits
    assert (got - expected).abs().max() <= 1e-4


def test_hidden_states_equal_transformers_and_feed_the_lm_head(pair):
    """`hidden_states` is HF's last hidden state (after the final norm): the LM head of it
    gives `forward`'s logits; left-padded rows equal each row alone."""
    hf_model, model = pair
    tokens, mask = left_pad(PROMPTS)
    got = model.hidden_states(tokens, mask)  # [B, T, H]
    assert got.dtype == torch.float32 and got.shape == (3, tokens.shape[1], 64)
    width = tokens.shape[1]
    for row, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = hf_model(torch.tensor([prompt]), output_hidden_states=True)
        mine = got[row, width - len(prompt) :]
        assert (mine - out.hidden_states[-1][0].float()).abs().max() <= 1e-4
        with torch.no_grad():
            head = model.net.lm_head(mine)
            cap = model.config.final_softcap  # Gemma's capped logits
            head = head if cap is None else torch.tanh(head / cap) * cap
            assert (head - out.logits[0].float()).abs().max() <= 1e-4
    assert got.abs().max() > 0.5  # not near-zero states


def test_incremental_decoding_equals_full_forward(pair):
    _, model = pair
    tokens = PROMPTS[0]
    full = native_logits(model, tokens)
    cache = model.new_cache(1)
    steps = [model.forward(torch.tensor([tokens[:4]]), cache)[0]]
    steps.append(model.forward(torch.tensor([tokens[4:6]]), cache)[0])  # a chunk after a prefix
    steps += [model.forward(torch.tensor([[t]]), cache)[0] for t in tokens[6:]]
    assert cache.length == len(tokens)
    assert (torch.cat(steps) - full).abs().max() <= 1e-4


def test_left_padded_rows_equal_each_row_alone(pair):
    _, model = pair
    tokens, mask = left_pad(PROMPTS)
    cache = model.new_cache(len(PROMPTS))
    batched = model.forward(tokens, cache, mask)  # [B, T, V]
    assert torch.isfinite(batched).all()  # padding positions too
    width = tokens.shape[1]
    alone = [native_logits(model, p) for p in PROMPTS]
    for row, prompt in enumerate(PROMPTS):
        assert (batched[row, width - len(prompt) :] - alone[row]).abs().max() <= 1e-4
    # Decode two more tokens per row, with row 1 padded in the first step.
    step = torch.tensor([[11], [21], [31]])
    batched = model.forward(step, cache, torch.tensor([[True], [False], [True]]))
    batched2 = model.forward(step + 1, cache)
    for row, prompt in enumerate(PROMPTS):
        extra = [11 + 10 * row, 12 + 10 * row] if row != 1 else [22]
        expected = native_logits(model, prompt + extra)[-1]
        assert (batched2[row, -1] - expected).abs().max() <= 1e-4
        if row != 1:
            expected = native_logits(model, prompt + [11 + 10 * row])[-1]
            assert (batched[row, -1] - expected).abs().max() <= 1e-4


def test_fork_equals_fresh_prefill(pair):
    _, model = pair
    logits, cache = prefill(model, PROMPTS)
    fork = cache.fork([2, 0, 2])
    assert fork.length == cache.length and fork.batch_size == 3
    got = model.forward(torch.tensor([[4], [5], [6]]), fork)[:, -1]
    for row, (source, token) in enumerate([(2, 4), (0, 5), (2, 6)]):
        expected = native_logits(model, PROMPTS[source] + [token])[-1]
        assert (got[row] - expected).abs().max() <= 1e-4
    # The parent is untouched by the fork's growth.
    assert cache.length == fork.length - 1
    again = model.forward(torch.tensor([[9], [9], [9]]), cache)[:, -1]
    for row, prompt in enumerate(PROMPTS):
        assert (again[row] - native_logits(model, prompt + [9])[-1]).abs().max() <= 1e-4


def test_crop_then_extend_equals_never_extended(pair):
    _, model = pair
    logits, cache = prefill(model, PROMPTS)
    model.forward(torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]]), cache)  # draft, rejected
    cache.crop(cache.length - 3)
    got = model.forward(torch.tensor([[50, 51], [52, 53], [54, 55]]), cache)
    for row, prompt in enumerate(PROMPTS):
        expected = native_logits(model, prompt + [50 + 2 * row, 51 + 2 * row])[-2:]
        assert (got[row] - expected).abs().max() <= 1e-4


def test_select_reorders_rows(pair):
    _, model = pair
    _, cache = prefill(model, PROMPTS)
    cache.select([1, 1, 0])
    got = model.forward(torch.tensor([[70], [71], [72]]), cache)[:, -1]
    for row, (source, token) in enumerate([(1, 70), (1, 71), (0, 72)]):
        expected = native_logits(model, PROMPTS[source] + [token])[-1]
        assert (got[row] - expected).abs().max() <= 1e-4


def test_greedy_tokens_equal_transformers_generate(pair):
    hf_model, model = pair
    prompt = PROMPTS[2]
    with torch.no_grad():
        # An explicit attention mask: the prompt holds token 0, which transformers would
        # otherwise take for padding.
        out = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
            max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    expected = out[0, len(prompt) :].tolist()
    logits, cache = prefill(model, [prompt])
    got = []
    for _ in range(8):
        token = int(logits[0].argmax())
        got.append(token)
        logits = model.forward(torch.tensor([[token]]), cache)[:, -1]
    assert got == expected


def dynamic_rope_pair(path, factor: float, seed: int):
    """A tiny Llama with dynamic-NTK RoPE over 16 trained positions, saved at `path`: the
    transformers model and decodekit's NativeLM of it."""
    config = transformers.LlamaConfig(
        **{**TINY, "max_position_embeddings": 16},
        rope_scaling={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": factor},
    )
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config)
    randomize(hf_model, seed=seed)
    hf_model.save_pretrained(path)
    return hf_model, NativeLM.from_pretrained(path)


def test_dynamic_ntk_rope_beyond_max_positions_matches_transformers(tmp_path):
    hf_model, model = dynamic_rope_pair(tmp_path, factor=2.0, seed=3)
    for length in (12, 24):  # within, then beyond, the 16 trained positions
        tokens = [(7 * i + 3) % 101 for i in range(length)]
        expected = hf_logits(hf_model.eval(), tokens)
        assert (native_logits(model, tokens) - expected).abs().max() <= 1e-4


def test_dynamic_ntk_rope_batched_greedy_equals_alone(tmp_path):
    """Each row's frequencies come from its own length (rope.py `RotaryTables.at`), so rows
    that pass the 16 trained positions at different steps decode the same batched on the
    engine, padded through `forward`, and alone (issue 37: two of three prompts differed,
    the batch sharing its longest row's frequencies)."""
    import decodekit as dk

    _, model = dynamic_rope_pair(tmp_path, factor=4.0, seed=5)
    prompts = [[(7 * i + 3 * j) % 100 + 1 for i in range(4 + 7 * j)] for j in range(3)]  # 4, 11, 18 tokens
    greedy = dk.SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    alone = [dk.generate(model, [prompt], greedy)[0][0].token_ids for prompt in prompts]
    batched = [samples[0].token_ids for samples in dk.generate(model, prompts, greedy)]
    assert batched == alone
    # NativeLM.forward over a left-padded batch: each row's last logits as alone
    width = max(map(len, prompts))
    tokens = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    padded = model.forward(tokens, model.new_cache(3), mask)[:, -1]
    for row, prompt in enumerate(prompts):
        assert (padded[row] - native_logits(model, prompt)[-1]).abs().max() <= 1e-4


def test_speculative_decoding_past_a_dynamic_rope_models_positions_equals_greedy(tmp_path):
    """Past the trained positions a forward's frequencies depend on its length: a
    verification gives each of its tokens its own length's, as decoding one by one does, so
    speculation equals greedy decoding there (it did not when a verification shared one
    length); a prompt longer than the trained positions is refused, with the numbers."""
    import decodekit as dk

    _, model = dynamic_rope_pair(tmp_path, factor=4.0, seed=5)
    prompt = [(7 * i + 3) % 100 + 1 for i in range(5)]
    past = dk.SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)  # to 35 positions
    result = dk.speculative_generate(model, model, [prompt], past, num_draft_tokens=3)
    assert result.completions[0][0].token_ids == dk.generate(model, [prompt], past)[0][0].token_ids
    with pytest.raises(ValueError, match="16 trained positions; this prompt has 17 tokens"):
        dk.speculative_generate(model, model, [list(range(1, 18))], past)


def test_metadata_sharded_weights_and_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    # (llama: transformers 5 picks Qwen2Tokenizer for a qwen2 config, whatever the files say)
    hf_model = save_family("llama-tied", tmp_path / "full")
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB")  # several shards + an index
    assert (tmp_path / "model.safetensors.index.json").exists()
    config = json.loads((tmp_path / "config.json").read_text())
    config["eos_token_id"] = [7, 9]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9 + 3}))
    vocab = {"<unk>": 0, "<eos>": 1, "to": 2, "be": 3, "or": 4, "not": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>"
    )
    fast.save_pretrained(tmp_path)
    model = NativeLM.from_pretrained(tmp_path)
    # generation_config.json first, then config.json, then the tokenizer's (as HFModelLM).
    assert model.eos_token_ids == (12, 7, 9, 1)
    assert model.encode("to be or not") == [2, 3, 4, 5]
    assert model.vocab_size == 101 and model.max_context == 64
    assert model.name == tmp_path.name
    # Tied weights are counted once, as in transformers.
    assert model.num_parameters() == sum(p.numel() for p in hf_model.parameters())
    tokens = PROMPTS[0]
    assert (native_logits(model, tokens) - hf_logits(hf_model, tokens)).abs().max() <= 1e-4


def test_old_config_layout_loads_the_same_rope(tmp_path):
    """transformers < 5 writes `rope_theta` and `rope_scaling` at the top level."""
    hf_model = save_family("linear-rope", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope["rope_type"], "factor": rope["factor"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = NativeLM.from_pretrained(tmp_path)
    assert model.config.rope.kind == "linear" and model.config.rope.theta == 500.0
    tokens = PROMPTS[0]
    assert (native_logits(model, tokens) - hf_logits(hf_model, tokens)).abs().max() <= 1e-4


def test_supports():
    config = transformers.Qwen2Config(**TINY).to_dict()
    config["architectures"] = ["Qwen2ForCausalLM"]
    assert NativeLM.supports(config)
    assert not NativeLM.supports({**config, "model_type": "gpt2"})
    assert not NativeLM.supports({**config, "architectures": ["GPT2LMHeadModel"]})
    assert not NativeLM.supports({**config, "rope_parameters": {"rope_type": "yarn"}})
    assert not NativeLM.supports({**config, "hidden_act": "relu2"})
    assert NativeLM.supports({**config, "hidden_act": "gelu"})  # transformers' Qwen2MLP takes any
    assert not NativeLM.supports({**config, "quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(ValueError, match="model_type"):
        NativeLM.from_state_dict({**config, "model_type": "gpt2"}, {})


def test_bfloat16_weights_give_float32_logits_close_to_float32(pair):
    hf_model, _ = pair
    state = {name: t.detach() for name, t in hf_model.state_dict().items()}
    model = NativeLM.from_state_dict(hf_model.config.to_dict(), state, dtype=torch.bfloat16)
    assert model.net.lm_head.weight.dtype == torch.bfloat16
    tokens = PROMPTS[0]
    got, expected = native_logits(model, tokens), hf_logits(hf_model, tokens)
    assert got.dtype == torch.float32
    # bfloat16 keeps 8 bits of mantissa: agreement to a few percent of the logit scale.
    assert (got - expected).abs().max() <= 0.05 * expected.abs().max()


def test_user_errors(pair):
    _, model = pair
    cache = model.new_cache(2)
    with pytest.raises(ValueError, match="rows"):
        model.forward(torch.zeros((3, 2), dtype=torch.long), cache)
    with pytest.raises(ValueError, match="token ids"):
        model.forward(torch.full((2, 2), 101), cache)
    with pytest.raises(ValueError, match="mask"):
        wide_mask = torch.ones((2, 3), dtype=torch.bool)
        model.forward(torch.zeros((2, 2), dtype=torch.long), cache, wide_mask)
    with pytest.raises(TypeError, match="cache"):
        model.forward(torch.zeros((2, 2), dtype=torch.long), object())
    model.forward(torch.zeros((2, 2), dtype=torch.long), cache)
    with pytest.raises(ValueError, match="crop length"):
        cache.crop(3)
    with pytest.raises(ValueError, match="rows"):
        cache.fork([2])


def test_cache_grows_past_its_capacity(pair):
    _, model = pair
    cache = model.new_cache(1)
    assert isinstance(cache, ContiguousKVCache)
    tokens = [(5 * i + 1) % 101 for i in range(40)]  # > the initial capacity of 16
    steps = [model.forward(torch.tensor([tokens[:10]]), cache)[0]]
    steps += [model.forward(torch.tensor([[t]]), cache)[0] for t in tokens[10:]]
    assert cache.capacity >= 40
    assert (torch.cat(steps) - native_logits(model, tokens)).abs().max() <= 1e-4


ASSETS = Path(__file__).parents[2] / "src" / "decodekit" / "models" / "assets"


@pytest.mark.parametrize("name", ["shakespeare", "shakespeare-draft"])
def test_embedded_model_logits_equal_transformers(name):
    path = ASSETS / name
    if not (path / "config.json").exists():
        pytest.skip(f"embedded model {name} not trained yet")
    model = NativeLM.from_pretrained(path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokens = model.encode("ROMEO: But soft, what light through yonder window breaks?")
    expected = hf_logits(hf_model.eval(), tokens)
    assert (native_logits(model, tokens) - expected).abs().max() <= 1e-4
