import json

import pytest
import torch

import decodekit as dk
from decodekit.compress import QuantizedLinear, model_nbytes
from decodekit.compress.pretrained import save_compressed_dir
from decodekit.compress.recipe import CompressConfig, calibration_batches, compress_lm
from decodekit.models.compressed import COMPRESSION_FILE, WEIGHTS_FILE
from decodekit.models.registry import load_model

CALIB_TEXT = "ROMEO: But soft, what light through yonder window breaks? It is the east. " * 12


def compressed(source, config: CompressConfig):
    model = load_model(source)
    summary = compress_lm(model, config, CALIB_TEXT)
    return model, summary


@pytest.mark.parametrize(
    "config",
    [
        CompressConfig("rtn", bits=8),
        CompressConfig("gptq", bits=4, group_size=16, calib_windows=4, calib_length=32),
        CompressConfig("rtn", bits=3),
        CompressConfig("sparsegpt", n_m="2:4", calib_windows=4, calib_length=32),
    ],
    ids=lambda c: c.label(),
)
def test_loaded_directory_gives_the_in_memory_logits(tiny_llama_dir, tmp_path, config):
    model, summary = compressed(tiny_llama_dir, config)
    assert len(summary.layers) == 8  # qkv, o, gate_up, down in each of 2 blocks
    out = save_compressed_dir(model, tmp_path / "c", tiny_llama_dir, summary)
    loaded = load_model(out)
    assert type(loaded).__name__ == "NativeLM" and loaded.name == "c"
    assert loaded.eos_token_ids == model.eos_token_ids
    tokens = torch.tensor([model.encode("JULIET: O Romeo, Romeo")])
    expected = model.forward(tokens, model.new_cache(1))
    assert torch.equal(loaded.forward(tokens, loaded.new_cache(1)), expected)
    # Float Linear layers get NativeLM's own (transposed) weight layout, as from_pretrained's.
    assert loaded.net.lm_head.weight.stride() == model.net.lm_head.weight.stride()
    quantized = config.method in ("rtn", "gptq")
    kinds = {type(m) for n, m in loaded.net.named_modules() if n.endswith("proj")}
    assert kinds == ({QuantizedLinear} if quantized else {torch.nn.Linear})
    # Through the engine (generate runs models with paged KV on it): the same greedy tokens.
    assert loaded.supports_paged_kv
    params = dk.SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    [a] = dk.generate(model, "ROMEO:", params)
    [b] = dk.generate(loaded, "ROMEO:", params)
    assert a.token_ids == b.token_ids


def test_directory_layout(tiny_llama_dir, tmp_path):
    model, summary = compressed(tiny_llama_dir, CompressConfig("rtn", bits=4))
    out = save_compressed_dir(model, tmp_path / "c", tiny_llama_dir, summary)
    names = {p.name for p in out.iterdir()}
    assert {COMPRESSION_FILE, WEIGHTS_FILE, "config.json", "tokenizer.json"} <= names
    assert "model.safetensors" not in names  # transformers must not read the codes as floats
    marker = json.loads((out / COMPRESSION_FILE).read_text())
    assert marker["summary"]["method"] == "rtn" and marker["summary"]["bits"] == 4
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    with pytest.raises(ValueError, match="native backend only"):
        load_model(out, backend="hf")
    with pytest.raises(ValueError, match="already exists and is not empty"):
        save_compressed_dir(model, out, tiny_llama_dir, summary)


@pytest.mark.usefixtures("torch_kernels_only")  # names PyTorch's kernels
def test_int8_directory_holds_fewer_bytes(tiny_llama_dir, tmp_path):
    model, summary = compressed(tiny_llama_dir, CompressConfig("rtn", bits=8))
    loaded = load_model(save_compressed_dir(model, tmp_path / "c", tiny_llama_dir, summary))
    float_bytes = model_nbytes(load_model(tiny_llama_dir).net)
    # Per block (hidden 32, 4 heads of 8, 2 KV heads, MLP 64): Linear weights [N, K] of
    # qkv 64x32, o 32x32, gate_up 128x32, down 32x64 = 9216 weights and 256 output rows.
    # float32 -> int8 codes plus one float32 scale per row saves 9216 * 3 - 256 * 4 bytes,
    # less the int8 kernel's bfloat16 copy of the scales (2 bytes per row).
    assert float_bytes - model_nbytes(loaded.net) == 2 * (9216 * 3 - 256 * 4 - 256 * 2)


def tied_checkpoint(source, vocab_size: int = 50):
    """A random 1-layer Llama with tied embeddings (50 tokens), saved to `source`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(3)
    LlamaForCausalLM(config).save_pretrained(source)
    return source


def test_tied_embeddings_survive_the_round_trip(tmp_path):
    source = tied_checkpoint(tmp_path / "tied")
    model = load_model(source)
    compress_lm(model, CompressConfig("rtn", bits=8))
    loaded = load_model(save_compressed_dir(model, tmp_path / "c", source))
    assert loaded.net.lm_head.weight is loaded.net.embed_tokens.weight
    tokens = torch.tensor([[1, 7, 3, 9, 4]])
    expected = model.forward(tokens, model.new_cache(1))
    assert torch.equal(loaded.forward(tokens, loaded.new_cache(1)), expected)


@pytest.mark.parametrize("head_bits", [8, 4])
def test_a_quantised_head_survives_the_round_trip_with_its_tied_embedding_on_its_grid(tmp_path, head_bits):
    """CompressConfig(head_bits): the output head becomes a QuantizedLinear of those bits, one
    scale per channel (RTN of the float head), and a tied embedding looks its rows up on that
    grid (QuantizedEmbedding: no float copy of the vocabulary, in memory or in the file); the
    directory reloads to the same logits, and without head_bits the head stays float (the
    default)."""
    import safetensors

    from decodekit.models.compressed import WEIGHTS_FILE
    from decodekit.models.qlinear import QuantizedEmbedding
    from decodekit.models.quant_grid import QuantSpec, dequantize, quantize_rtn

    source = tied_checkpoint(tmp_path / "tied")
    model = load_model(source)
    embedding = model.net.embed_tokens.weight.detach().clone()
    summary = compress_lm(model, CompressConfig("rtn", bits=8, head_bits=head_bits))
    assert summary.head_bits == head_bits and summary.layers[-1] == "lm_head"
    head = model.net.lm_head
    assert isinstance(head, QuantizedLinear) and head.spec == QuantSpec(head_bits)
    codes, scales = quantize_rtn(embedding, QuantSpec(head_bits))
    assert torch.equal(head.dequantized_weight(), dequantize(codes, scales))
    tokens = torch.tensor([[1, 7, 3, 9, 4]])
    assert isinstance(model.net.embed_tokens, QuantizedEmbedding)  # the lookup reads the head's values
    assert torch.equal(model.net.embed_tokens(tokens), dequantize(codes, scales)[tokens])
    assert not any(p.shape[0] == model.vocab_size for p in model.net.parameters())  # no float vocabulary
    out = save_compressed_dir(model, tmp_path / "c", source, summary)
    with safetensors.safe_open(str(out / WEIGHTS_FILE), "pt") as stored:
        assert "embed_tokens.weight" not in stored.keys()  # noqa: SIM118
    loaded = load_model(out)
    assert isinstance(loaded.net.lm_head, QuantizedLinear)
    assert isinstance(loaded.net.embed_tokens, QuantizedEmbedding)
    expected = model.forward(tokens, model.new_cache(1))
    assert torch.equal(loaded.forward(tokens, loaded.new_cache(1)), expected)
    plain = load_model(source)
    compress_lm(plain, CompressConfig("rtn", bits=8))
    assert type(plain.net.lm_head) is torch.nn.Linear


def test_auto_quantises_the_head_of_a_real_vocabulary(tmp_path):
    """head_bits "auto" (the default): 8 bits from 32,000 tokens (real tokenizers), a float head
    below (the package's 2,048-token models), never for pruning; explicit settings win."""
    from decodekit.compress.recipe import AUTO_HEAD_VOCAB
    from decodekit.models.qlinear import QuantizedEmbedding

    auto = CompressConfig("gptq", bits=4)
    assert auto.head_bits == "auto" and auto.label() == "gptq-4b"
    assert [auto.head_bits_for(v) for v in (2048, AUTO_HEAD_VOCAB, 151_936)] == [None, 8, 8]
    assert CompressConfig("rtn", head_bits=None).head_bits_for(151_936) is None
    assert CompressConfig("rtn", head_bits=4).head_bits_for(2048) == 4
    assert CompressConfig("magnitude").head_bits_for(151_936) is None
    source = tied_checkpoint(tmp_path / "real", vocab_size=AUTO_HEAD_VOCAB)
    model = load_model(source)
    summary = compress_lm(model, CompressConfig("rtn", bits=4))
    assert summary.head_bits == 8 and isinstance(model.net.lm_head, QuantizedLinear)
    assert isinstance(model.net.embed_tokens, QuantizedEmbedding)
    small = load_model(tied_checkpoint(tmp_path / "small"))
    compress_lm(small, CompressConfig("rtn", bits=4))
    assert type(small.net.lm_head) is torch.nn.Linear


def test_calibration_windows_are_token_segments(tiny_lm):
    ids = tiny_lm.encode(CALIB_TEXT)
    batches = calibration_batches(tiny_lm, CALIB_TEXT, windows=5, length=12, batch_size=2)
    assert [tuple(b.shape) for b in batches] == [(2, 12), (2, 12), (1, 12)]
    for row in torch.cat(batches).tolist():
        assert any(ids[s : s + 12] == row for s in range(len(ids) - 11))
    with pytest.raises(ValueError, match="fewer than one window"):
        calibration_batches(tiny_lm, "ROMEO:", windows=1, length=12)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "awq"}, "method must be one of rtn, gptq, magnitude, sparsegpt, got 'awq'"),
        ({"method": "rtn", "bits": 9}, "bits must be in 2..8, got 9"),
        ({"method": "gptq", "bits": 1}, "bits must be in 2..8, got 1"),
        ({"method": "magnitude", "sparsity": 1.0}, r"sparsity must be in \[0, 1\), got 1.0"),
        ({"method": "sparsegpt", "sparsity": -0.1}, r"sparsity must be in \[0, 1\), got -0.1"),
        ({"method": "rtn", "sparsity": 0.5}, "sparsity does not apply to method 'rtn'"),
        ({"method": "magnitude", "bits": 4}, "bits does not apply to method 'magnitude'"),
        ({"method": "magnitude", "sparsity": 0.5, "n_m": "2:4"}, "sparsity or n_m, not both"),
        ({"method": "magnitude", "n_m": "4:2"}, "n_m needs 0 < n < m"),
        ({"method": "gptq", "calib_windows": 0}, "calib_windows must be >= 1, got 0"),
        ({"method": "rtn", "head_bits": 3},
         r"head_bits must be 8, 4, None \(the head in float\) or 'auto', got 3"),
        ({"method": "magnitude", "head_bits": 8}, "head_bits does not apply to method 'magnitude'"),
    ],
)
def test_bad_configs_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CompressConfig(**kwargs)


def test_compress_lm_needs_a_native_model(toy_lm):
    with pytest.raises(TypeError, match="NativeLM"):
        compress_lm(toy_lm, CompressConfig("rtn"))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_other_llama_families_round_trip(tmp_path, family):
    import transformers

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                  tie_word_embeddings=False)  # fmt: skip
    if family == "qwen2":  # q/k/v biases
        config, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    else:  # per-head q/k RMSNorm
        config, cls = transformers.Qwen3Config(head_dim=8, **common), transformers.Qwen3ForCausalLM
    torch.manual_seed(4)
    cls(config).save_pretrained(tmp_path / family)
    model = load_model(tmp_path / family)
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    compress_lm(model, CompressConfig("gptq", group_size=8, calib_windows=2, calib_length=16),
                [i % 64 for i in range(0, 7 * 300, 7)])  # token ids: no tokenizer  # fmt: skip
    loaded = load_model(save_compressed_dir(model, tmp_path / "c", tmp_path / family))
    qkv = loaded.net.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear) and (qkv.bias is not None) == (family == "qwen2")
    expected = model.forward(tokens, model.new_cache(1))
    assert torch.equal(loaded.forward(tokens, loaded.new_cache(1)), expected)


@pytest.mark.usefixtures("torch_kernels_only")  # names PyTorch's kernels
@pytest.mark.parametrize(
    ("config", "kernels"),
    [(CompressConfig("rtn", bits=8), {"int8pack": 16}),
     # groups of 64 leave the down projections (688 inputs) in float
     (CompressConfig("rtn", bits=4, group_size=64), {"int4pack": 12}),
     (CompressConfig("gptq", bits=4, calib_windows=4, calib_length=64), {"int4pack": 16})],
    ids=lambda c: c.label() if isinstance(c, CompressConfig) else "",
)
def test_packed_kernels_decode_as_the_unpacking_fallback(config, kernels):
    # The embedded model (trained, so its greedy choices have margins): the packed path
    # (bfloat16 activations around each matmul) and the float32 fallback give the same greedy
    # tokens and logits within bfloat16 rounding, both for decoding and for a prompt longer
    # than PACKED_MAX_ROWS (the dequantised bfloat16 GEMM).
    from decodekit.models.qlinear import kernel_counts, set_kernels

    model = load_model("shakespeare")
    compress_lm(model, config)
    assert kernel_counts(model.net) == kernels
    params = dk.SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = torch.tensor([model.encode("ROMEO: " + CALIB_TEXT)[:100]])  # [1, 100]
    [packed] = dk.generate(model, "ROMEO:", params)
    packed_logits = model.forward(tokens, model.new_cache(1))
    set_kernels(model.net, "unpack")
    [unpacked] = dk.generate(model, "ROMEO:", params)
    unpacked_logits = model.forward(tokens, model.new_cache(1))
    assert packed.token_ids == unpacked.token_ids
    error = (packed_logits - unpacked_logits).norm() / unpacked_logits.norm()
    assert float(error) < 0.01  # measured about 0.003
