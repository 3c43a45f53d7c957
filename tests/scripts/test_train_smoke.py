"""scripts/train_lm.py: a few-step smoke run on a tiny slice, resume, and the loss/schedule maths."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


train_lm = load_script("train_lm")


def test_tiny_run_trains_saves_and_resumes(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    threads = str(torch.get_num_threads())  # leave the test process's threading unchanged
    argv = ["--config", "shakespeare", "--tiny", "--out", str(out), "--threads", threads]
    train_lm.main([*argv, "--steps", "3"])
    history = json.loads((out / "history.json").read_text())
    losses = [h["train_loss"] for h in history["history"] if "train_loss" in h]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert math.isfinite(history["val_loss"])

    final = out / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    ids = tokenizer("ROMEO:", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], len(tokenizer))
    assert model.config.eos_token_id == tokenizer.eos_token_id

    # a second call with more steps continues from the checkpoint instead of restarting
    capsys.readouterr()
    train_lm.main([*argv, "--steps", "5"])
    log = capsys.readouterr().out
    assert "resumed from" in log and "at step 3" in log
    assert "step     4" in log and "step     1 " not in log


def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    def fresh_model():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=32,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=32, tie_word_embeddings=True)
        return LlamaForCausalLM(config)

    ids = torch.arange(400) % 20
    kw = dict(seq_len=8, batch_size=2, steps=6, lr=1e-2, warmup=2, eval_every=2, log_every=1)
    straight = fresh_model()
    train_lm.train_causal_lm(straight, ids, ids[:100], out_dir=str(tmp_path / "a"), **kw)

    # kill the second run during step 5: its last checkpoint is the one saved at step 4
    killed = fresh_model()
    calls = []

    def die_on_fifth_training_step(module, args):
        calls.append(module.training)
        if sum(calls) == 5:
            raise RuntimeError("killed")

    killed.register_forward_pre_hook(die_on_fifth_training_step)
    with pytest.raises(RuntimeError, match="killed"):
        train_lm.train_causal_lm(killed, ids, ids[:100], out_dir=str(tmp_path / "b"), **kw)
    assert torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["step"] == 4

    resumed = fresh_model()
    result = train_lm.train_causal_lm(resumed, ids, ids[:100], out_dir=str(tmp_path / "b"), **kw)
    assert [h["step"] for h in result["history"] if "train_loss" in h] == [1, 2, 3, 4, 5, 6]
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_evaluate_loss_of_a_uniform_model_is_log_vocab():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=7, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=16, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()  # tied: every logit is 0, p = 1/7
    ids = torch.arange(25) % 7
    loss, count = train_lm.evaluate_loss(model, ids, seq_len=4, batch_size=3)
    assert count == 24  # 6 non-overlapping windows of 4 predictions
    assert loss == pytest.approx(math.log(7), abs=1e-5)
    loss, count = train_lm.evaluate_loss(model, ids, seq_len=4, batch_size=3, max_windows=2)
    assert count == 8


def test_learning_rate_schedule():
    lr = train_lm.learning_rate
    assert lr(0.0, 0, 1.0, 4) == pytest.approx(0.25)  # warmup: (step + 1) / warmup
    assert lr(0.0, 3, 1.0, 4) == pytest.approx(1.0)
    assert lr(0.0, 4, 1.0, 4) == pytest.approx(1.0)  # cosine from the peak ...
    assert lr(0.5, 50, 1.0, 4) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr(1.0, 99, 1.0, 4) == pytest.approx(0.1)  # ... down to lr / 10


def test_encode_documents_puts_eos_after_each_document():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(train_lm.ASSETS / "shakespeare")
    eos = tokenizer.eos_token_id
    ids = train_lm.encode_documents(tokenizer, "ROMEO:\nHi.\n<|endoftext|>\n\nJULIET:\nHo.\n")
    assert (ids == eos).sum().item() == 2 and ids[-1].item() == eos
    first = ids[: ids.tolist().index(eos)].tolist()
    assert tokenizer.decode(first) == "ROMEO:\nHi."


def test_progress_bar_replaces_the_step_lines(tmp_path, capsys, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    ids = torch.arange(400) % 20
    kw = dict(seq_len=8, batch_size=2, steps=2, lr=1e-2, warmup=1, eval_every=2, log_every=1)
    monkeypatch.setattr("decodekit.runtime.PROGRESS_INTERVAL", 0.0)  # a line at least at the end
    train_lm.train_causal_lm(LlamaForCausalLM(config), ids, ids[:100], out_dir=str(tmp_path / "bar"),
                             progress=True, **kw)
    captured = capsys.readouterr()
    assert "train: 2/2 (100%)" in captured.err  # off a terminal: progress lines (runtime.py)
    assert "| loss" not in captured.out and "val loss" in captured.out  # eval lines stay
    train_lm.train_causal_lm(LlamaForCausalLM(config), ids, ids[:100], out_dir=str(tmp_path / "log"),
                             **kw)  # capsys is not a terminal: the log lines, no bar
    captured = capsys.readouterr()
    assert "train:" not in captured.err and "step     2 | loss" in captured.out


def test_keep_best_saves_the_model_at_the_lowest_validation_loss(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         tie_word_embeddings=True)
    ids = torch.arange(400) % 20
    # a learning rate far too high: the validation loss falls, then rises, so the best model
    # is not the last one
    kw = dict(seq_len=8, batch_size=2, steps=8, lr=0.3, warmup=1, eval_every=1, log_every=1)
    model = LlamaForCausalLM(config)
    result = train_lm.train_causal_lm(model, ids, ids[:100], out_dir=str(tmp_path / "r"), keep_best=True,
                                      **kw)  # fmt: skip
    periodic = [h["val_loss"] for h in result["history"] if "val_loss" in h and not h.get("final")]
    assert len(periodic) == 8 and periodic.index(min(periodic)) < len(periodic) - 1
    best = LlamaForCausalLM.from_pretrained(tmp_path / "r" / "best")
    loss, _ = train_lm.evaluate_loss(best, ids[:100], 8, 2, train_lm.EVAL_WINDOWS)
    assert loss == pytest.approx(min(periodic), rel=1e-5)
    kw["steps"] = 1
    train_lm.train_causal_lm(LlamaForCausalLM(config), ids, ids[:100], out_dir=str(tmp_path / "r2"), **kw)
    assert not (tmp_path / "r2" / "best").exists()  # off by default
