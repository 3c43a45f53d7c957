import pytest
import safetensors
import torch
from torch import nn

from decodekit.compress import (
    QuantizedLinear,
    load_compressed,
    prune_model,
    quantize_model,
    read_compression_config,
    save_compressed,
)

transformers = pytest.importorskip("transformers")


def tiny_llama(seed: int, tie: bool = False):
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def quantized_modules(model) -> dict[str, QuantizedLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}


@pytest.mark.parametrize(
    ("method", "bits", "group_size", "tie"),
    [("rtn", 8, None, False), ("gptq", 4, 32, False), ("rtn", 3, 16, True)],
)
def test_round_trip_is_bit_exact(tmp_path, method, bits, group_size, tie):
    model = tiny_llama(0, tie)
    calib = [torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))]
    summary = quantize_model(model, method, bits, group_size, calib_batches=calib)
    path = tmp_path / "model.safetensors"
    save_compressed(model, path, summary)

    with safetensors.safe_open(str(path), framework="pt") as handle:
        stored = handle.get_tensor("model.layers.0.mlp.up_proj.qweight")
    assert stored.dtype == (torch.int8 if bits > 4 else torch.uint8)

    fresh = tiny_llama(5, tie)  # different random weights everywhere
    config = load_compressed(fresh, path)
    assert config["summary"]["method"] == method and config["summary"]["bits"] == bits
    assert config["quantized"]["model.layers.1.mlp.down_proj"] == {
        "in_features": 128,
        "out_features": 64,
        "bits": bits,
        "group_size": group_size,
        "bias": False,
        "activation_bits": None,
    }
    saved, loaded = quantized_modules(model), quantized_modules(fresh)
    assert saved.keys() == loaded.keys() and len(saved) == 14
    for name, module in saved.items():
        assert torch.equal(module.qweight, loaded[name].qweight), name
        assert torch.equal(module.scales, loaded[name].scales), name
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, fresh(tokens).logits)
    if tie:
        assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()


def test_pruned_checkpoint_keeps_zeros_and_summary(tmp_path):
    model = tiny_llama(0)
    summary = prune_model(model, "magnitude", n_m="2:4")
    path = tmp_path / "pruned.safetensors"
    save_compressed(model, path, summary)
    fresh = tiny_llama(5)
    config = load_compressed(fresh, path)
    assert config["summary"]["n_m"] == [2, 4] and config["quantized"] == {}
    assert torch.equal(fresh.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)


def test_plain_safetensors_has_no_config_and_shapes_are_checked(tmp_path):
    import safetensors.torch

    path = tmp_path / "plain.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(2)}, str(path))
    assert read_compression_config(path) is None

    model = nn.Sequential(nn.Linear(8, 4))
    quantize_model(model, "rtn", 8)
    save_compressed(model, tmp_path / "q.safetensors")
    with pytest.raises(ValueError, match="checkpoint is 4x8, model is 4x16"):
        load_compressed(nn.Sequential(nn.Linear(16, 4)), tmp_path / "q.safetensors")
