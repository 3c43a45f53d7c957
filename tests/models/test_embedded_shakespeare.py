"""The shipped Shakespeare target/draft pair: loads by name, matches transformers, as listed."""

from __future__ import annotations

import json

import pytest
import torch

from decodekit.models.registry import ASSETS, embedded_models, load_model

NAMES = ["shakespeare", "shakespeare-draft"]
PROMPT = "ROMEO:\nBut, soft! what light through yonder window breaks?\n"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend", ["native", "hf"])
def test_loads_by_name_and_logits_match_transformers(name, backend):
    from transformers import AutoModelForCausalLM

    model = load_model(name, backend=backend)
    reference = AutoModelForCausalLM.from_pretrained(ASSETS / name, dtype=torch.float32).eval()
    ids = model.encode(PROMPT)
    tokens = torch.tensor([ids])  # [1, T]
    logits = model.forward(tokens, model.new_cache(1))  # [1, T, V]
    with torch.no_grad():
        expected = reference(tokens).logits
    assert logits.shape == (1, len(ids), 2048)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert model.eos_token_ids == (model.tokenizer.eos_token_id,)
    assert model.decode(ids) == PROMPT


def test_registry_lists_both_with_measured_figures():
    entries = embedded_models()
    target, draft = entries["shakespeare"], entries["shakespeare-draft"]
    for name, entry in (("shakespeare", target), ("shakespeare-draft", draft)):
        files = {f.name for f in (ASSETS / name).iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
        assert entry["size_bytes"] == sum(f.stat().st_size for f in (ASSETS / name).iterdir())
        config = json.loads((ASSETS / name / "config.json").read_text())
        assert config["model_type"] == "llama" and config["vocab_size"] == 2048
    assert target["parameters"] == load_model("shakespeare").num_parameters()
    # the contract: at least 8x fewer parameters, and a clearly better target
    assert target["parameters"] >= 8 * draft["parameters"]
    assert target["val_ppl_token"] < 0.9 * draft["val_ppl_token"]
    assert target["test_ppl_token"] < 0.9 * draft["test_ppl_token"]


def test_same_tokenizer_for_target_and_draft():
    target = (ASSETS / "shakespeare" / "tokenizer.json").read_bytes()
    assert target == (ASSETS / "shakespeare-draft" / "tokenizer.json").read_bytes()


# A slice of the held-out test plays: enough for 20+ full-context windows, a few seconds.
HELD_OUT_SLICE = 10_000  # characters, about 3,700 tokens


@pytest.mark.parametrize("name", ["shakespeare", "shakespeare-draft"])
def test_perplexity_at_full_context_no_worse_than_at_half(name):
    """Issue 13, item 2: a model trained on windows of its whole declared context is as good
    at the end of its context as in its first half. Both evaluations score the same tokens
    (stride = window / 2); the full window gives every token at least twice the context."""
    from decodekit.compress.evaluate import HELD_OUT, text_perplexity

    model = load_model(name)
    text = HELD_OUT["test"].read_text()[:HELD_OUT_SLICE]
    full = text_perplexity(model, text, window=model.max_context)
    half = text_perplexity(model, text, window=model.max_context // 2)
    assert full.tokens == half.tokens
    assert full.perplexity <= 1.02 * half.perplexity, (full.perplexity, half.perplexity)


def test_published_perplexity_is_what_eval_perplexity_measures():
    """registry.json (and so MODELS.md and `decodekit models`) reports the figures of the one
    protocol: `text_perplexity` with its defaults, i.e. `decodekit eval perplexity NAME`."""
    from decodekit.compress.evaluate import text_perplexity

    entry = embedded_models()["shakespeare-draft"]
    model = load_model("shakespeare-draft")
    for split in ("test", "val"):
        result = text_perplexity(model, split=split)
        assert result.window == model.max_context and result.stride == model.max_context // 2
        assert result.perplexity == pytest.approx(entry[f"{split}_ppl_token"], abs=2e-3)
        assert result.bits_per_char == pytest.approx(entry[f"{split}_bits_per_char"], abs=2e-4)
    assert entry["metric"]["test_ppl"] == round(entry["test_ppl_token"], 2)
