"""Writing compressed checkpoints: one safetensors file with the integer codes, scales and
every other tensor of the model, plus the JSON compression config in the file's metadata.
The format, and reading it back (`load_compressed`), are models/compressed.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch
from torch import nn

from decodekit.compress.apply import CompressionSummary
from decodekit.models.compressed import CHECKPOINT_FORMAT, METADATA_KEY
from decodekit.models.qlinear import QuantizedLinear


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
            # Zero points (GGUF's Q4_K, models/qlinear.py): named only where a layer has them.
            **({"offsets": True} if module.offsets is not None else {}),
            "activation_bits": module.spec.activation_bits,
        }
        for name, module in model.named_modules()
        if isinstance(module, QuantizedLinear)
    }
    config = {
        "format": CHECKPOINT_FORMAT,
        "summary": summary.to_dict() if summary is not None else None,
        "quantized": quantized,
    }
    # save_model (unlike save_file) accepts tied weights such as a shared lm_head.
    safetensors.torch.save_model(model, str(path), metadata={METADATA_KEY: json.dumps(config)})
