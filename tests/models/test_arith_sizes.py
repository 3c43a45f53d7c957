"""The arith sizes shipped for the compute-optimal comparison (issue 17, item 2): each with its
own ORM/PRM pointing at it, about 4x apart in parameters, and the assets under 60 MB."""

from __future__ import annotations

import json

import pytest

from decodekit.models.registry import ASSETS, embedded_models

SIZES = ("arith-small", "arith", "arith-large")


def test_sizes_are_about_four_times_apart_with_their_own_reward_models():
    entries = embedded_models()
    parameters = [entries[name]["parameters"] for name in SIZES]
    assert [b / a for a, b in zip(parameters, parameters[1:])] == [pytest.approx(4, rel=0.1)] * 2
    for name in SIZES:
        config = json.loads((ASSETS / name / "config.json").read_text())
        assert config["num_hidden_layers"] == 3 and config["vocab_size"] == 37  # same recipe
        assert entries[name]["size_bytes"] == sum(f.stat().st_size for f in (ASSETS / name).iterdir())
        for kind in ("orm", "prm"):
            probe = json.loads((ASSETS / f"{name}-{kind}" / "probe.json").read_text())
            assert probe["policy"] == f"../{name}" and entries[f"{name}-{kind}"]["policy"] == name


def test_shipped_assets_stay_small():
    """The small models and data under 30 MB; `shakespeare-large`, the memory-bound target
    (issue 36: the package may grow by at most 120 MB for it), under 40 MB as int8."""
    large = ASSETS / "shakespeare-large"
    sizes = {f: f.stat().st_size for f in ASSETS.rglob("*") if f.is_file()}
    small = sum(size for f, size in sizes.items() if large not in f.parents)
    assert small < 30e6, f"models/assets holds {small / 1e6:.1f} MB besides shakespeare-large"
    assert sum(sizes.values()) - small < 40e6
