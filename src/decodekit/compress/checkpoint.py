"""Compressed checkpoints: one safetensors file with the integer codes, scales and every
other tensor of the model, plus a small JSON compression config in the file's metadata.

Metadata key "decodekit.compression" holds
    {"format": 1, "summary": {...CompressionSummary...},
     "quantized": {module name: {"in_features", "out_features", "bits", "group_size", "bias"}}}
A `QuantizedLinear` at "model.layers.0.mlp.up_proj" stores "...up_proj.qweight" (int8, or
uint8 with two 4-bit codes per byte, `pack_int4`'s layout) and "...up_proj.scales" (float32). Loading replaces
those Linear layers of a freshly built float model by empty `QuantizedLinear`s and copies
the stored tensors in unchanged, so codes and scales round-trip bit for bit. Pruned models
need nothing special (their zeros are stored densely); the summary still records the run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
from torch import nn

from decodekit.compress.apply import CompressionSummary, replace_module
from decodekit.compress.qlinear import QuantizedLinear

METADATA_KEY = "decodekit.compression"
FORMAT_VERSION = 1


def save_compressed(
    model: nn.Module, path: str | Path, summary: CompressionSummary | None = None
) -> None:
    """Write the model's state (tied tensors once) and the compression config to `path`."""
    quantized = {
        name: {
            "in_features": module.in_features,
            "out_features": module.out_features,
            "bits": module.spec.bits,
            "group_size": module.spec.group_size,
            "bias": module.bias is not None,
        }
        for name, module in model.named_modules()
        if isinstance(module, QuantizedLinear)
    }
    config = {
        "format": FORMAT_VERSION,
        "summary": summary.to_dict() if summary is not None else None,
        "quantized": quantized,
    }
    # save_model (unlike save_file) accepts tied weights such as a shared lm_head.
    safetensors.torch.save_model(model, str(path), metadata={METADATA_KEY: json.dumps(config)})


def read_compression_config(path: str | Path) -> dict[str, Any] | None:
    """The JSON compression config of a checkpoint, or None for a plain safetensors file."""
    with safetensors.safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    text = metadata.get(METADATA_KEY)
    if text is None:
        return None
    config = json.loads(text)
    if config.get("format") != FORMAT_VERSION:
        raise ValueError(f"unsupported compressed checkpoint format {config.get('format')!r}")
    return config


def load_compressed(model: nn.Module, path: str | Path) -> dict[str, Any] | None:
    """Load a checkpoint written by `save_compressed` into `model` (same architecture, float).

    Linear layers listed in the config become `QuantizedLinear`s first. Returns the config.
    """
    config = read_compression_config(path)
    for name, spec in (config or {}).get("quantized", {}).items():
        linear = model.get_submodule(name)
        if not isinstance(linear, (nn.Linear, QuantizedLinear)):
            kind = type(linear).__name__
            raise ValueError(f"checkpoint quantises {name!r}, but the model has a {kind} there")
        if (linear.in_features, linear.out_features) != (spec["in_features"], spec["out_features"]):
            raise ValueError(
                f"{name!r}: checkpoint is {spec['out_features']}x{spec['in_features']}, "
                f"model is {linear.out_features}x{linear.in_features}"
            )
        replace_module(
            model,
            name,
            QuantizedLinear(
                spec["in_features"],
                spec["out_features"],
                spec["bits"],
                spec["group_size"],
                spec["bias"],
            ),
        )
    missing, unexpected = safetensors.torch.load_model(model, str(path), strict=True)
    assert not missing and not unexpected
    return config
