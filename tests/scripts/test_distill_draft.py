"""scripts/distill_draft.py: the teacher's top-k labels, the distillation loss, layer-drop
initialisation, and a short run that makes a student agree more with its teacher."""

from __future__ import annotations

import inspect
import json
import math
import shutil
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "src" / "decodekit" / "models" / "assets"
sys.path.insert(0, str(Path(__file__).parent))
from test_train_smoke import load_script  # noqa: E402

distill = load_script("distill_draft")


def test_the_loss_is_the_cross_entropy_against_the_renormalised_top_k():
    logits = torch.tensor([[[2.0, 0.0, -1.0, 0.5]]])  # [B=1, T=1, V=4]
    values = torch.tensor([[[-0.5, -1.5]]])  # the teacher's top-2 log-probabilities (unnormalised)
    indices = torch.tensor([[[3, 0]]], dtype=torch.int16)
    p = torch.tensor([math.exp(-0.5), math.exp(-1.5)])
    p = p / p.sum()
    logq = torch.log_softmax(logits[0, 0], -1)
    expected = -(p[0] * logq[3] + p[1] * logq[0])
    loss = distill.distill_loss(logits, values, indices, torch.tensor([[1]]), hard=0.0)
    torch.testing.assert_close(loss, expected)
    with_text = distill.distill_loss(logits, values, indices, torch.tensor([[1]]), hard=0.5)
    torch.testing.assert_close(with_text, expected - 0.5 * logq[1])


def test_keeping_layers_gives_a_shallower_model_of_those_layers():
    from decodekit.models.hf import load_causal_lm

    model = load_causal_lm(ASSETS / "shakespeare-draft")  # 2 layers
    second = model.model.layers[1]
    distill.keep_layers(model, [1])
    assert model.config.num_hidden_layers == 1 and model.model.layers[0] is second
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0]
    ids = torch.tensor([[5, 6, 7, 8]])
    full = model(input_ids=ids).logits
    step = model(input_ids=ids[:, :3], use_cache=True)  # the cache indexes the kept layers
    # transformers 5 names the cache `cache` (`past_key_values` is deprecated); 4.x the latter
    new_name = "cache" in inspect.signature(model.forward).parameters
    cache = step["cache"] if new_name else step.past_key_values
    last = model(input_ids=ids[:, 3:], **{"cache" if new_name else "past_key_values": cache}).logits
    torch.testing.assert_close(last[0, -1], full[0, -1], atol=1e-4, rtol=1e-4)


def test_a_short_run_writes_labels_and_raises_the_students_agreement(tmp_path):
    data = tmp_path / "data"
    (data / "tokenizer").mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ASSETS / "shakespeare" / name, data / "tokenizer" / name)
    text = (ASSETS / "data" / "shakespeare_val.txt").read_text()
    (data / "train.txt").write_text(text[:40_000])
    (data / "val.txt").write_text(text[60_000:80_000])
    out = tmp_path / "run"
    # the teacher's first layer alone as the student: far from the teacher, cheap to train
    argv = ["--teacher", "shakespeare-draft", "--student", "shakespeare-draft", "--layers", "0",
            "--data", str(data),
            "--out", str(out), "--top-k", "16", "--epochs", "4", "--lr", "1e-3",
            "--eval-every", "1000", "--eval-windows", "2", "--threads", str(torch.get_num_threads())]
    distill.main(argv)
    chunk = torch.load(out / "teacher" / "chunk_0000.pt")
    assert chunk["values"].shape[-1] == 16 and chunk["indices"].dtype == torch.int16
    assert (chunk["values"][..., :-1] >= chunk["values"][..., 1:]).all()  # sorted, largest first
    history = json.loads((out / "history.json").read_text())
    first, last = history[0], history[-1]
    assert first["step"] == 0 and last["step"] > 0
    # measured: 0.34 -> 0.64 of the argmaxes, 0.57 -> 0.65 of the probability mass
    assert last["agree_t0"] > first["agree_t0"] + 0.1 and last["agree_t1"] > first["agree_t1"], history
    assert (out / "best" / "config.json").exists() and (out / "best" / "tokenizer.json").exists()
