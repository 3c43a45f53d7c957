"""`shakespeare-large-draft`: the draft distilled from `shakespeare-large` (issue 36), shipped
beside it and named by its registry entry as its default draft."""

from __future__ import annotations

import json

import torch

from decodekit.compress.evaluate import HELD_OUT
from decodekit.models.registry import ASSETS, default_draft, embedded_models, load_model


def test_it_ships_in_the_small_drafts_shape_with_the_targets_tokenizer():
    entry = embedded_models()["shakespeare-large-draft"]
    folder = ASSETS / "shakespeare-large-draft"
    assert entry["size_bytes"] == sum(f.stat().st_size for f in folder.iterdir())
    assert entry["teacher"] == "shakespeare-large" and default_draft("shakespeare-large") == folder.name
    config = json.loads((folder / "config.json").read_text())
    small = json.loads((ASSETS / "shakespeare-draft" / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "max_position_embeddings", "vocab_size"):
        assert config[key] == small[key], key
    assert load_model("shakespeare-large-draft").num_parameters() == entry["parameters"]
    shipped = (ASSETS / "shakespeare-large" / "tokenizer.json").read_bytes()
    assert (folder / "tokenizer.json").read_bytes() == shipped


def test_distillation_made_it_agree_with_the_target_more_than_the_text_trained_draft():
    """What the draft is for: on held-out text, its next-token argmax is the target's more
    often than `shakespeare-draft`'s (same shape, trained on the text alone): 0.60 against 0.45
    on these 512 tokens of the test plays (0.555 against 0.428 on 16 validation windows)."""
    target = load_model("shakespeare-large")
    ids = target.encode(HELD_OUT["test"].read_text()[:4_000])[:512]
    tokens = torch.tensor([ids])
    want = target.forward(tokens, target.new_cache(1))[0].argmax(-1)  # [T]
    agree = {}
    for name in ("shakespeare-large-draft", "shakespeare-draft"):
        draft = load_model(name)
        agree[name] = (draft.forward(tokens, draft.new_cache(1))[0].argmax(-1) == want).float().mean().item()
    assert agree["shakespeare-large-draft"] > agree["shakespeare-draft"] + 0.05, agree
