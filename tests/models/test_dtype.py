"""`load_model(..., dtype=...)`: bfloat16 weights, activations and KV cache, float32 logits."""

from __future__ import annotations

import pytest
import torch

import decodekit as dk
from decodekit.models.base import logprobs, prefill
from decodekit.models.registry import load_model, resolve_dtype


@pytest.fixture(scope="module")
def shakespeare_f32():
    return load_model("shakespeare")


@pytest.mark.parametrize("dtype", [torch.bfloat16, "bfloat16"])
def test_bfloat16_load_gives_float32_logits_close_to_float32(shakespeare_f32, dtype):
    model = load_model("shakespeare", dtype=dtype)
    assert {p.dtype for p in model.net.parameters()} == {torch.bfloat16}
    assert model.new_cache(1).keys.dtype == torch.bfloat16
    ids = shakespeare_f32.encode("ROMEO: But soft, what light through yonder window breaks?")
    got, expected = prefill(model, [ids])[0], prefill(shakespeare_f32, [ids])[0]  # [1, V]
    assert got.dtype == torch.float32 and logprobs(model, torch.tensor([ids])).dtype == torch.float32
    # bfloat16 keeps 8 bits of mantissa: agreement to a few percent of the logit scale.
    assert (got - expected).abs().max() <= 0.05 * expected.abs().max()


def test_bfloat16_greedy_generation_runs(shakespeare_f32):
    model = load_model("shakespeare", dtype="bfloat16")
    params = dk.SamplingParams(temperature=0.0, max_new_tokens=12, logprobs=1)
    (completion,) = dk.generate(model, "ROMEO:", params)
    assert len(completion.token_ids) == 12 and completion.text
    assert all(lp <= 0.0 for lp in completion.logprobs)


def test_auto_is_the_checkpoints_dtype():
    assert load_model("shakespeare").net.embed_tokens.weight.dtype == torch.float32
    assert load_model("shakespeare", dtype="float32").dtype == torch.float32
    # On an accelerator "auto" is the stored dtype ("dtype" before the older "torch_dtype").
    cuda = torch.device("cuda")
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}, cuda) == torch.bfloat16
    assert resolve_dtype("auto", {"dtype": "float16", "torch_dtype": "float32"}, cuda) == torch.float16
    assert resolve_dtype("auto", {}, cuda) == torch.float32


def test_auto_on_the_cpu_asks_the_probe_for_bfloat16_and_widens_float16(monkeypatch):
    from decodekit.models import dtype_probe

    for verdict in (torch.bfloat16, torch.float32):  # the probe's own tests: test_dtype_probe.py
        monkeypatch.setattr(dtype_probe, "cpu_bfloat16_dtype", lambda v=verdict: v)
        assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}) == verdict
    assert resolve_dtype("auto", {"torch_dtype": "float16"}) == torch.float32
    assert resolve_dtype("auto", {"torch_dtype": "float32"}) == torch.float32
    assert resolve_dtype("auto", {}) == torch.float32
    # An explicit choice is never changed.
    assert resolve_dtype("float16", {"torch_dtype": "float32"}) == torch.float16


def test_hf_backend_takes_the_dtype(tiny_llama_dir):
    model = load_model(tiny_llama_dir, backend="hf", dtype="bfloat16")
    assert model.model.dtype == torch.bfloat16
    logits, _ = prefill(model, [[1, 2, 3]])  # [1, V]
    assert logits.dtype == torch.float32


@pytest.mark.parametrize("dtype", ["bf16", "int8", torch.int8, None])
def test_a_bad_dtype_names_the_allowed_values(dtype):
    with pytest.raises(ValueError, match="dtype must be one of 'auto', 'float32', 'bfloat16', 'float16'"):
        load_model("shakespeare", dtype=dtype)


def test_ngram_models_run_in_float32_only():
    with pytest.raises(ValueError, match="runs in float32 only"):
        load_model("shakespeare-5gram", dtype="bfloat16")
    assert load_model("shakespeare-5gram", dtype="auto") is not None
