"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) on decodekit's own forward.

tests/models/test_native.py runs the plain-loop suite (batches, padding, fork, crop, bfloat16)
on the three families beside the others, against transformers' logits. Here: the routing
against a sum written out by hand, the paged engine (batched, sampled, batch-invariant) against
transformers, what the compiled steps refuse, compression (the router left in float) and a
saved compressed model.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from tiny_weights import hf_greedy, hf_logits, save_tiny
from torch import nn

import decodekit as dk
from decodekit.compress.pretrained import save_compressed_dir
from decodekit.compress.recipe import CompressConfig, compress_lm
from decodekit.engine.config import EngineConfig
from decodekit.engine.engine import Engine
from decodekit.models.feedforward import MoE
from decodekit.models.native import NativeLM
from decodekit.models.native_config import NativeConfig
from decodekit.models.qlinear import QuantizedLinear
from decodekit.models.registry import load_model
from decodekit.models.rope import RopeConfig
from decodekit.models.static import StaticDecodeLM

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, eos_token_id=None, bos_token_id=None,
            pad_token_id=None)  # fmt: skip
PROMPTS = [[5, 17, 3, 99, 42, 8], [7, 1, 88, 14, 64, 9, 0, 12, 77, 3, 50, 6, 6, 1, 2, 3, 4, 5, 9, 21]]
NEW_TOKENS = 20
TOL = 1e-4
SEQUENCE = [(7 * i + 3) % 97 for i in range(40)]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def configs(vocab_size: int) -> dict[str, transformers.PretrainedConfig]:
    return {
        # 3 experts a token: the order they are summed in shows in the bits (two sum either way)
        "mixtral": transformers.MixtralConfig(**TINY, vocab_size=vocab_size, num_local_experts=6,
                                              num_experts_per_tok=3),
        # the shared expert (test_native: an MLP in some layers)
        "qwen2_moe": transformers.Qwen2MoeConfig(
            **TINY, vocab_size=vocab_size, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40,
            shared_expert_intermediate_size=56),
    }  # fmt: skip


def save(config, path, tokenizer_dir) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return save_tiny(config, path, tokenizer_dir, seed=3)


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def moe(request, tmp_path_factory, tiny_llama_dir):
    """(transformers model, decodekit model, its directory), with the tiny Llama's tokenizer."""
    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save(configs(vocab)[request.param], path, tiny_llama_dir)
    model = load_model(path)
    assert isinstance(model, NativeLM)
    return hf_model, model, path


def tiny_moe(normalize: bool, shared: int) -> MoE:
    config = NativeConfig(
        model_type="qwen3_moe", vocab_size=8, hidden_size=6, intermediate_size=10, num_layers=1,
        num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, max_positions=16,
        rope=RopeConfig(head_dim=4), num_experts=4, experts_per_token=2, expert_size=5,
        normalize_expert_weights=normalize, shared_expert_size=shared, expert_layers=(True,))  # fmt: skip
    moe = MoE(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    return moe


def mlp_by_hand(mlp, x: torch.Tensor) -> torch.Tensor:
    gate, up = (mlp.gate_up_proj.weight @ x).chunk(2)
    return mlp.down_proj.weight @ (torch.nn.functional.silu(gate) * up)


def by_hand(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token's output written out: every expert run, the top 2 of the router's softmax
    kept (renormalised if so), plus the sigmoid-gated shared expert."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(moe.gate.weight @ x[t], dim=0)
        top = sorted(range(len(probs)), key=lambda e: -float(probs[e]))[:2]
        total = float(probs[top].sum()) if moe.normalize else 1.0
        for e in top:
            out[t] += float(probs[e]) / total * mlp_by_hand(moe.experts[e], x[t])
        if moe.shared_expert is not None:
            gate = torch.sigmoid(moe.shared_expert_gate.weight[0] @ x[t])
            out[t] += gate * mlp_by_hand(moe.shared_expert, x[t])
    return out


@pytest.mark.parametrize("normalize, shared", [(True, 0), (False, 0), (False, 7)])
def test_the_routing_is_the_weighted_sum_of_each_tokens_top_experts(normalize, shared):
    moe = tiny_moe(normalize, shared)
    x = torch.randn(9, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = by_hand(moe, x)
        assert torch.allclose(moe(x[None])[0], expected, atol=1e-5)  # 9 tokens: grouped by expert
        for t in range(9):  # one token: its own experts, no gather
            assert torch.allclose(moe(x[None, t : t + 1])[0, 0], expected[t], atol=1e-5)
        chosen, weights = moe.route(x)
    assert chosen.shape == (9, 2) and len(set(chosen.flatten().tolist())) > 2  # several experts in use
    sums = weights.sum(dim=-1)
    assert torch.allclose(sums, torch.ones(9)) if normalize else bool((sums < 1).all())


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_engine_generates_like_transformers(moe, batch_invariant):
    hf_model, base, _ = moe
    model = NativeLM(base.net, base.config, batch_invariant=batch_invariant)
    greedy = dk.SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    sampled = dk.SamplingParams(max_new_tokens=NEW_TOKENS, seed=1, n=3, ignore_eos=True)
    got = dk.generate(model, PROMPTS + [PROMPTS[1]], [greedy, greedy, sampled])  # the engine
    for prompt, [completion] in zip(PROMPTS, got[:2]):
        assert completion.token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS)
    for prompt, completions in zip(PROMPTS + [PROMPTS[1]], got):  # every row's log-probs are transformers'
        for completion in completions:
            sequence = prompt + completion.token_ids
            logits = hf_logits(hf_model, sequence)[len(prompt) - 1 : -1]
            chosen = torch.tensor(completion.token_ids)[:, None]
            expected = torch.log_softmax(logits, -1).gather(-1, chosen)[:, 0]
            assert completion.logprobs == pytest.approx(expected.tolist(), abs=TOL)
    assert len({tuple(c.token_ids) for c in got[2]}) > 1  # the samples differ


def test_a_token_gets_the_same_bits_whatever_shares_its_forward(moe):
    """The batch-invariant mode: a prompt's logits alone equal its logits beside another, bit for
    bit, though the other's tokens send other rows through its experts; and fed one token a
    forward (each token's experts run alone) they equal the prompt's in one forward (the
    experts grouped over its tokens)."""
    _, base, _ = moe
    model = NativeLM(base.net, base.config, batch_invariant=True)
    alone = model.forward(torch.tensor([PROMPTS[0]]), model.new_cache(1))[0]
    other = PROMPTS[1][: len(PROMPTS[0])]
    together = model.forward(torch.tensor([PROMPTS[0], other]), model.new_cache(2))[0]
    assert torch.equal(alone, together)
    cache = model.new_cache(1)
    stepped = torch.cat([model.forward(torch.tensor([[token]]), cache)[0] for token in PROMPTS[0]])
    assert torch.equal(stepped, alone)


def test_the_compiled_steps_are_refused_by_name_and_the_engine_runs_eager(moe):
    _, base, _ = moe
    model = NativeLM(base.net, base.config, tokenizer=base.tokenizer)
    greedy = dk.SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    engine = Engine(model, EngineConfig(compile=True, block_size=4, num_blocks=256))
    reason = "a mixture of experts picks its experts on the host (models/feedforward.py)"
    assert engine.compile_refused == reason
    handle = engine.submit(PROMPTS[0], greedy)
    while engine.has_work():
        engine.step()
    assert handle.result(0)[0].token_ids == dk.generate(base, [PROMPTS[0]], greedy)[0][0].token_ids
    with pytest.raises(ValueError, match="mixture of experts"):
        StaticDecodeLM(model)


@pytest.mark.parametrize("method, bits", [("rtn", 8), ("gptq", 4)])
def test_compression_quantises_the_experts_and_leaves_the_router(moe, tmp_path, method, bits):
    """The experts (and a shared expert) become quantised layers; the router and the shared
    expert's gate stay float, as llama.cpp keeps ffn_gate_inp. GPTQ's calibration reaches only
    the experts some token chose; the others take round-to-nearest. Saved and loaded: the same
    logits, near the float model's."""
    _, base, path = moe
    model = load_model(path)
    config = CompressConfig(method, bits=bits, calib_windows=4, calib_length=40)
    summary = compress_lm(model, config, SEQUENCE * 6)
    for block in model.net.layers:
        if isinstance(block.mlp, MoE):
            assert type(block.mlp.gate) is nn.Linear
            assert all(isinstance(e.down_proj, QuantizedLinear) for e in block.mlp.experts)
            if block.mlp.shared_expert is not None:
                assert type(block.mlp.shared_expert_gate) is nn.Linear
                assert isinstance(block.mlp.shared_expert.gate_up_proj, QuantizedLinear)
    tokens = torch.tensor([SEQUENCE])
    expected = model.forward(tokens, model.new_cache(1))
    loaded = load_model(save_compressed_dir(model, tmp_path / "c", path, summary))
    assert torch.equal(loaded.forward(tokens, loaded.new_cache(1)), expected)
    # The quantisation error at this tiny random shape, per position, of logits up to ~8: int8
    # ~0.1 where no token's experts changed (a changed choice, where two experts' scores were
    # close, moves that position's by up to ~1, as in any quantised mixture); int4 ~1.3 (a
    # Llama of these widths: ~1.0)
    error = (expected - base.forward(tokens, base.new_cache(1))).abs().amax(dim=-1)[0]
    assert error.median() < (0.2 if bits == 8 else 2.0)


@pytest.mark.parametrize("tensor_type", ["f32", "q8_0"])
def test_a_gguf_file_holds_the_experts_as_llama_cpp_stores_them(moe, tmp_path, tensor_type):
    """`write_gguf` stacks each projection's experts into one [E, out, in] tensor (llama.cpp's
    ffn_*_exps), keeps the router in f32, and the file reads back as the checkpoint's model:
    the same logits in f32; in q8_0 every expert a quantised layer and the router float."""
    pytest.importorskip("gguf")
    from decodekit.compress.gguf import write_gguf
    from decodekit.models.gguf_model import read_gguf

    _, base, path = moe
    out = write_gguf(path, tmp_path / "moe.gguf", tensor_type)
    _, tensors = read_gguf(out)
    c = base.config
    assert [int(d) for d in tensors["blk.0.ffn_gate_exps.weight"].shape] == [64, c.expert_size, c.num_experts]
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    model = load_model(str(out))
    assert model.config == base.config
    tokens = torch.tensor([SEQUENCE])
    logits = model.forward(tokens, model.new_cache(1))
    expected = base.forward(tokens, base.new_cache(1))
    if tensor_type == "f32":
        assert torch.equal(logits, expected)
        return
    experts = [e for block in model.net.layers if isinstance(block.mlp, MoE) for e in block.mlp.experts]
    assert all(isinstance(e.gate_up_proj, QuantizedLinear) for e in experts)
    assert all(type(block.mlp.gate) is nn.Linear for block in model.net.layers if isinstance(block.mlp, MoE))
    assert (logits - expected).abs().amax(dim=-1).median() < 0.2  # q8_0's error (~0.1), as int8's above


def test_a_compressed_mixture_is_written_with_its_own_codes(moe, tmp_path):
    """A compressed directory's experts keep their int4 codes in the file (q4_0 blocks): its
    logits are the compressed model's but for the scales' float16 rounding."""
    pytest.importorskip("gguf")
    from decodekit.compress.gguf import write_gguf

    _, _, path = moe
    model = load_model(path)
    summary = compress_lm(model, CompressConfig("rtn", bits=4, group_size=32))
    out = write_gguf(save_compressed_dir(model, tmp_path / "c", path, summary), tmp_path / "c.gguf")
    from_file = load_model(str(out))
    tokens = torch.tensor([SEQUENCE])
    error = (from_file.forward(tokens, from_file.new_cache(1)) - model.forward(tokens, model.new_cache(1)))
    assert error.abs().amax(dim=-1).median() < 0.05


@pytest.mark.parametrize("change, message", [
    ({"norm_topk_prob": False}, "llama.cpp's qwen3moe takes norm_topk_prob True, this model False"),
    ({"mlp_only_layers": [1]}, r"llama.cpp's qwen3moe gives every layer experts; layers \[1\] have an MLP"),
])  # fmt: skip
def test_gguf_writing_refuses_what_llama_cpps_graph_would_run_otherwise(tmp_path, tiny_llama_dir, change,
                                                                          message):
    """llama.cpp renormalises the chosen experts' weights by architecture (qwen2moe never,
    qwen3moe and Mixtral always), and gives every layer experts."""
    pytest.importorskip("gguf")
    from decodekit.compress.gguf import write_gguf

    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    fields = dict(**TINY, vocab_size=vocab, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  norm_topk_prob=True)
    config = transformers.Qwen3MoeConfig(**{**fields, **change})
    save(config, tmp_path / "hf", tiny_llama_dir)
    with pytest.raises(ValueError, match=message):
        write_gguf(tmp_path / "hf", tmp_path / "x.gguf")


def test_speculative_decoding_with_a_mixture_as_target_is_greedy_decoding(moe):
    """Verification spans send several tokens of a row through the experts at once (the
    grouped path); with an int4 copy of the mixture as the draft (its experts quantised),
    greedy speculative decoding gives the target's own greedy tokens."""
    _, base, _ = moe
    greedy = dk.SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    [want] = dk.generate(base, "ROMEO: But soft", greedy)
    result = dk.speculative_generate(base, "self-int4", "ROMEO: But soft", greedy, fallback=False)
    [got] = result.completions  # a single string prompt: its n = 1 completions
    assert got.token_ids == want.token_ids
    assert result.stats.drafted_tokens > 0 and result.stats.accepted_tokens > 0
