"""Int8 storage of a checkpoint (models/int8_storage.py) and the shipped model stored that way."""

from __future__ import annotations

import json

import pytest
import torch

from decodekit.models import int8_storage
from decodekit.models.checkpoint import load_safetensors
from decodekit.models.registry import ASSETS, embedded_models, load_model


def test_codes_and_scales_by_hand():
    # one row, two groups of 4: scales max|w| / 127 (as float16), codes w / scale rounded
    weight = torch.tensor([[1.27, -0.635, 0.0, 0.3175, 2.54, 2.54, -2.54, 0.01]])
    codes, scales = int8_storage.quantise(weight, 4)
    assert scales.dtype == torch.float16
    torch.testing.assert_close(scales.float(), torch.tensor([[0.01, 0.02]]), rtol=1e-3, atol=0)
    # float16's 0.01 is 0.0100021: -0.635 / 0.0100021 = -63.49 -> -63 (against the stored scale)
    assert codes.tolist() == [[127, -63, 0, 32, 127, 127, -127, 0]]


def test_round_trip_error_is_at_most_half_a_step(tmp_path):
    torch.manual_seed(0)
    state = {"layer.weight": torch.randn(64, 256), "norm.weight": torch.randn(256),
             "other.weight": torch.randn(8, 96)}  # fmt: skip   96 columns: one group per row
    paths = int8_storage.save(state, tmp_path, group_size=128, shard_bytes=10_000)
    assert len(paths) == 2  # the 16 KiB matrix over 10,000 bytes: a shard of its own
    assert int8_storage.is_int8_storage(tmp_path)
    loaded = load_safetensors(tmp_path)
    assert set(loaded) == set(state) and all(t.dtype == torch.float32 for t in loaded.values())
    assert torch.equal(loaded["norm.weight"], state["norm.weight"])  # vectors exactly
    for name, group in (("layer.weight", 128), ("other.weight", 96)):
        w = state[name].reshape(state[name].shape[0], -1, group)
        step = (w.abs().amax(-1, keepdim=True) / 127).half().float()
        error = (loaded[name].reshape(w.shape) - w).abs()
        assert (error <= step / 2 * 1.001 + 1e-7).all()
        assert error.max() > 0  # it did round


def test_a_column_count_the_group_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="group_size 64 does not divide the 96 columns"):
        int8_storage.quantise(torch.zeros(2, 96), 64)


def test_shakespeare_large_ships_as_int8_and_loads_in_float32():
    entry = embedded_models()["shakespeare-large"]
    folder = ASSETS / "shakespeare-large"
    assert int8_storage.is_int8_storage(folder)
    assert entry["size_bytes"] == sum(f.stat().st_size for f in folder.iterdir())
    assert entry["size_bytes"] < 40e6  # the bound is 120 MB; float32 would be 143 MB
    model = load_model("shakespeare-large")
    assert model.num_parameters() == entry["parameters"]
    assert all(p.dtype == torch.float32 for p in model.net.parameters())
    config = json.loads((folder / "config.json").read_text())
    assert config["max_position_embeddings"] == 512 and config["vocab_size"] == 2048
    # the same tokenizer as the drafts: its speculative decoding pairs with them
    shipped = (ASSETS / "shakespeare" / "tokenizer.json").read_bytes()
    assert (folder / "tokenizer.json").read_bytes() == shipped


def test_shakespeare_large_logits_match_transformers():
    hf = load_model("shakespeare-large", backend="hf")
    native = load_model("shakespeare-large")
    ids = native.encode("ROMEO:\nBut, soft! what light through yonder window breaks?\n")
    tokens = torch.tensor([ids])
    torch.testing.assert_close(native.forward(tokens, native.new_cache(1)),
                               hf.forward(tokens, hf.new_cache(1)), atol=2e-4, rtol=2e-4)  # fmt: skip
