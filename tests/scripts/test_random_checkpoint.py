"""scripts/random_checkpoint.py writes a checkpoint of the asked shape that NativeLM loads and
that `decodekit plan` sizes from its headers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_small_shape(tmp_path, capsys):
    from decodekit.models.footprint import plan_memory
    from decodekit.models.registry import load_model

    sys.path.insert(0, str(SCRIPTS))
    try:
        import random_checkpoint
    finally:
        sys.path.remove(str(SCRIPTS))
    out = tmp_path / "qwen-tiny"
    random_checkpoint.main(["--out", str(out), "--layers", "2", "--hidden", "64", "--intermediate", "96",
                            "--heads", "4", "--kv-heads", "2", "--vocab", "50"])
    assert "head_dim 16" in capsys.readouterr().out
    model = load_model(out)
    c = model.config
    assert (c.model_type, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == \
        ("qwen2", 2, 4, 2, 16, 50)
    assert c.qkv_bias and c.tie_word_embeddings
    parameters = sum(p.numel() for p in model.net.parameters())
    assert plan_memory(str(out), context=8)["parameters"] == parameters
    with pytest.raises(SystemExit):  # a second run refuses to overwrite
        random_checkpoint.main(["--out", str(out)])
