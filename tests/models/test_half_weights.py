"""Half weights in a float32 model (models/half_linear.py `keep_half_weights`): a bfloat16 or
float16 checkpoint that runs in float32 on the CPU keeps its linear layers' weights as stored.
Widening a half value is exact, so every path (the kernels' rows, a prefill's widened GEMM,
the batch-invariant mode, no kernels at all) must give the float32 model's numbers for the
same values, with half the weight bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import decodekit as dk
from decodekit.models import kernels, registry, shapes
from decodekit.models.base import prefill
from decodekit.models.half_linear import HalfEmbedding, HalfWeightLinear, keep_half_weights

HALVES = [torch.bfloat16, torch.float16]


def tiny_config(dtype: str, tied: bool) -> dict:
    """Qwen2.5's architecture (q/k/v biases) at tiny widths, stored in `dtype`."""
    config = shapes.shape_config("qwen2.5-0.5b", dtype)
    config.update(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, num_hidden_layers=2, tie_word_embeddings=tied)
    return config


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("half")
    return {(name, tied): shapes.save_checkpoint(tiny_config(name, tied), root / f"{name}-{tied}")
            for name in ("bfloat16", "float16") for tied in (True, False)}  # fmt: skip


def pair(checkpoints, dtype: torch.dtype, tied: bool):
    """The checkpoint loaded in float32 (every weight widened), and a copy with half weights."""
    path = checkpoints[(str(dtype).removeprefix("torch."), tied)]
    wide, half = dk.load_model(path, dtype="float32"), dk.load_model(path, dtype="float32")
    keep_half_weights(half.net, dtype)
    return wide, half


def linear_weights(model) -> list[torch.Tensor]:
    return [m.weight for m in model.net.modules() if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_half_weights_give_the_float32_models_logits(checkpoints, dtype, tied, monkeypatch):
    wide, half = pair(checkpoints, dtype, tied)
    head = half.net.lm_head.weight
    assert half.dtype == torch.float32 and head.dtype == dtype
    assert (head is half.net.embed_tokens.weight) == tied  # a tied lookup reads the head's half weight
    assert isinstance(half.net.embed_tokens, HalfEmbedding) == tied
    layers = [w for w in linear_weights(half) if w is not head]
    assert layers and all(w.dtype == dtype and w.is_contiguous() for w in layers)
    widened = [w for w in linear_weights(wide) if w is not wide.net.lm_head.weight]
    assert 2 * sum(w.nbytes for w in layers) == sum(w.nbytes for w in widened)
    assert all(isinstance(m, HalfWeightLinear) for m in half.net.layers.modules() if isinstance(m, nn.Linear))
    ids = [[(7 * i) % 200 + 1 for i in range(23)]]
    want = prefill(wide, ids)[0]  # 23 rows: the kernels' rows
    torch.testing.assert_close(prefill(half, ids)[0], want, rtol=0, atol=2e-5)
    monkeypatch.setattr(kernels, "_half_weight_rows", 16)  # past it (AVX2: 128 rows), the widened GEMM
    torch.testing.assert_close(prefill(half, ids)[0], want, rtol=0, atol=2e-5)
    monkeypatch.undo()
    for model in (wide, half):
        model.batch_invariant = True
    torch.testing.assert_close(prefill(half, ids)[0], prefill(wide, ids)[0], rtol=0, atol=2e-5)
    for model in (wide, half):
        model.batch_invariant = False
    greedy = dk.SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    tokens = [dk.generate(m, ids, greedy)[0][0].token_ids for m in (wide, half)]  # one-row decode steps
    assert tokens[0] == tokens[1]
    monkeypatch.setattr(kernels, "available", lambda: False)  # no kernels: every call widened
    torch.testing.assert_close(prefill(half, ids)[0], want, rtol=0, atol=2e-5)


@pytest.mark.skipif(not kernels.available(), reason="half weights are kept only where the kernels read them")
@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_auto_keeps_a_half_checkpoints_weights_where_it_runs_in_float32(checkpoints, dtype, monkeypatch):
    from decodekit.models import dtype_probe

    monkeypatch.setattr(dtype_probe, "cpu_bfloat16_dtype", lambda: torch.float32)  # a CPU slow at bfloat16
    path = checkpoints[(str(dtype).removeprefix("torch."), False)]
    model = dk.load_model(path)
    assert model.dtype == torch.float32
    assert {w.dtype for w in linear_weights(model)} == {dtype}
    assert {w.dtype for w in linear_weights(dk.load_model(path, dtype="float32"))} == {torch.float32}
    if dtype == torch.bfloat16:  # where bfloat16 arithmetic is fast, the model is bfloat16
        monkeypatch.setattr(dtype_probe, "cpu_bfloat16_dtype", lambda: torch.bfloat16)
        assert dk.load_model(path).dtype == torch.bfloat16
    assert registry.half_weights_dtype("auto", {"torch_dtype": "float16"}, "cuda") is None


def test_only_half_dtypes_are_kept(checkpoints):
    wide, _ = pair(checkpoints, torch.bfloat16, False)
    with pytest.raises(ValueError, match="half weights must be bfloat16 or float16, got torch.float32"):
        keep_half_weights(wide.net, torch.float32)


@pytest.mark.skipif(not kernels.available(), reason="half weights are kept only where the kernels read them")
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_memory_plan_counts_the_half_weights_it_keeps(checkpoints, tied):
    """`decodekit plan` (models/footprint.py) sizes a float16 checkpoint's weights as they load
    under "auto": the linear layers' float16, the rest float32."""
    from decodekit.models.footprint import plan_memory

    path = checkpoints[("float16", tied)]
    model = dk.load_model(path)
    held = sum(t.nbytes for t in model.net.parameters())  # a tied weight once
    assert plan_memory(str(path), context=16)["weight_bytes"] == held
    wide = plan_memory(str(path), context=16, dtype="float32")["weight_bytes"]
    assert wide == sum(t.nbytes for t in dk.load_model(path, dtype="float32").net.parameters()) > held
