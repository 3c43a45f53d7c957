"""Random-weight models of real layer shapes (models/shapes.py, issue 15 item 4)."""

from __future__ import annotations

import json

import pytest
import torch

import decodekit as dk
from decodekit.models.base import prefill
from decodekit.models.native import LlamaNet, NativeLM
from decodekit.models.native_config import NativeConfig
from decodekit.models.registry import ASSETS
from decodekit.models.shapes import (
    SHAPES,
    VOCAB_SIZE,
    random_model,
    random_state_dict,
    save_checkpoint,
    shape_config,
)


def parameters_of(config: dict) -> int:
    with torch.device("meta"):
        net = LlamaNet(NativeConfig.from_dict(config))
    return sum(p.numel() for p in net.parameters())


# The published parameter counts (134.5M, 494.0M, 1,235.8M, 999.9M, 8,030.3M) minus the
# embedding rows past the 2,048 kept: (49,152 - 2,048) x 576, (151,936 - 2,048) x 896,
# (128,256 - 2,048) x 2,048, (262,144 - 2,048) x 1,152; Llama-3.1-8B's untied head too, and 28
# of its 32 layers of 218.112M.
SIZES = [("smollm2-135m", 134.5 - 27.1), ("qwen2.5-0.5b", 494.0 - 134.3),
         ("qwen2.5-0.5b-16l", 240.4), ("llama-3.2-1b", 1235.8 - 258.5),
         ("gemma-3-1b", 999.886 - 299.631),
         ("llama-3.1-8b-4l", 8030.261 - 2 * 126_208 * 4096 / 1e6 - 28 * 218.112)]  # fmt: skip


@pytest.mark.parametrize(("name", "millions"), SIZES)
def test_each_shape_has_its_models_layers_and_the_embedded_vocabulary(name, millions):
    config = shape_config(name)
    shipped = json.loads((ASSETS / "shakespeare" / "config.json").read_text())
    assert config["vocab_size"] == VOCAB_SIZE == shipped["vocab_size"]
    assert parameters_of(config) == pytest.approx(millions * 1e6, rel=0.002)
    assert NativeConfig.from_dict(config).num_layers == SHAPES[name]["num_hidden_layers"]


def test_the_cli_lists_the_same_shapes():
    from decodekit.cli.bench import SHAPES as CLI_SHAPES

    assert tuple(SHAPES) == CLI_SHAPES


def test_an_unknown_shape_names_the_known_ones():
    with pytest.raises(ValueError, match="shape must be one of 'smollm2-135m'.*got 'gpt2'"):
        shape_config("gpt2")


def small(name: str, layers: int = 2) -> dict:
    """A shape's config with fewer layers (the same widths, heads and RoPE), for speed."""
    return {**shape_config(name), "num_hidden_layers": layers}


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "llama-3.2-1b", "gemma-3-1b"])
def test_a_saved_random_checkpoint_loads_natively_and_in_transformers_alike(name, tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_checkpoint(small(name), tmp_path / name)
    model = dk.load_model(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = model.encode("ROMEO: But soft, what light through yonder window breaks?")
    ours = prefill(model, [ids])[0][0]  # [V]
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    # Spread logits (standard deviation ~3), not a flat or saturated distribution.
    assert 1.5 < float(ours.std()) < 6.0
    assert float(torch.softmax(ours, -1).max()) < 0.9


def test_random_weights_are_seeded():
    config = small("smollm2-135m", layers=1)
    first, again, other = (random_state_dict(config, seed) for seed in (0, 0, 1))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    model = NativeLM.from_state_dict(config, first)
    assert model.vocab_size == VOCAB_SIZE


def test_random_model_builds_the_shape_in_the_dtype():
    model = random_model("smollm2-135m", dtype="bfloat16", layers=2)
    assert model.num_parameters() == parameters_of(small("smollm2-135m", layers=2))
    assert model.dtype == torch.bfloat16 and model.device.type == "cpu"
    [completion] = dk.generate(model, "ROMEO:", dk.SamplingParams(max_new_tokens=3, temperature=0))
    assert len(completion.token_ids) == 3
    with pytest.raises(ValueError, match=r"layers must be in \[1, 30\], got 31"):
        random_model("smollm2-135m", layers=31)
