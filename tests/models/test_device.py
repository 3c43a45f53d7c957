"""`load_model(device=...)`: the device names, their errors, and the bfloat16 one-row path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import decodekit as dk
from decodekit.models.base import prefill
from decodekit.models.half_linear import one_row_gemv
from decodekit.models.registry import load_model, resolve_device


@pytest.mark.parametrize("device", ["gpu", "tpu", "", 3, None])
def test_a_bad_device_names_the_allowed_values(device):
    with pytest.raises(ValueError, match="device must be one of 'auto', 'cpu', 'cuda', 'mps'"):
        load_model("shakespeare", device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_missing_device_is_a_clear_error():
    with pytest.raises(ValueError, match="device 'cuda' is not available on this machine"):
        load_model("shakespeare", device="cuda")
    assert resolve_device("auto") == torch.device("cpu")


def test_ngram_models_stay_on_the_cpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a second device to refuse")
    with pytest.raises(ValueError, match="runs on the CPU only"):
        load_model("shakespeare-5gram", device="cuda")


def test_cpu_is_the_default_and_auto_resolves():
    model = load_model("shakespeare", device="auto")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert model.device.type == expected == model.new_cache(1).keys.device.type
    assert load_model("shakespeare").device == torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_row_gemv_is_the_linear_layer(dtype):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48, bias=True).to(dtype)
    x = torch.randn(1, 1, 64, dtype=dtype)
    expected = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    torch.testing.assert_close(one_row_gemv(layer, x).float(), expected, rtol=2e-2, atol=2e-2)


def test_bfloat16_decoding_one_token_agrees_with_its_prefill():
    """A decode step (one row: the GEMV path) and a prefill (GEMM) give the same next-token
    logits to bfloat16 precision, and the same greedy tokens as the float32 model mostly."""
    model = load_model("shakespeare", dtype="bfloat16")
    assert model.net.layers[0].mlp.down_proj.weight.is_contiguous()  # row-major, for the GEMV
    ids = model.encode("ROMEO: But soft, what light through yonder window breaks?")
    whole = prefill(model, [ids])[0]  # [1, V]
    _, cache = prefill(model, [ids[:-1]])
    step = model.forward(torch.tensor([ids[-1:]]), cache)[:, -1]
    assert (step - whole).abs().max() <= 0.05 * whole.abs().max()
    params = dk.SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    [ours] = dk.generate(model, "ROMEO:", params)
    [full] = dk.generate(load_model("shakespeare"), "ROMEO:", params)
    assert sum(a == b for a, b in zip(ours.token_ids, full.token_ids)) >= 8
