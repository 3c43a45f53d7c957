"""Reading compressed models: the checkpoint file and the directory that `decodekit compress
--out DIR` writes (compress/checkpoint.py and compress/pretrained.py write them) and
`load_model(DIR)` reads (`load_compressed_dir`).

    DIR/compression.json              {"format": 1, "weights": ..., "base": ..., "summary": {...}}
    DIR/config.json                   the source model's config (tie_word_embeddings explicit)
    DIR/tokenizer*.json, generation_config.json, ...   copied from the source directory
    DIR/model.compressed.safetensors  `save_compressed(lm.net)`: int8 or packed int4 codes,
                                      scales and every other tensor, under NativeLM's fused
                                      names (qkv_proj, gate_up_proj)

`compression.json` is the marker the model registry dispatches on. The weights are not
called model.safetensors so that transformers (and `HFModelLM`) never take the integer
codes and fused names for a float checkpoint: they fail loudly ("no model.safetensors")
instead. Loading builds `LlamaNet` without initialising it (meta device, then empty CPU
storage) and copies the stored tensors in, so int8/int4 weights stay integers in memory.

The checkpoint is one safetensors file with the integer codes, scales and every other
tensor of the model, plus a small JSON compression config in the file's metadata. Metadata
key "decodekit.compression" holds
    {"format": 1, "summary": {...CompressionSummary...},
     "quantized": {module name: {"in_features", "out_features", "bits", "group_size", "bias",
                                 "activation_bits"}}}
("activation_bits": 8 makes the layer quantise its input, W8A8 / W4A8, models/qlinear.py;
null or absent: weight-only), so a reloaded model computes what the compressed one did.
A `QuantizedLinear` at "model.layers.0.mlp.up_proj" stores "...up_proj.qweight" (int8, or
uint8 with two 4-bit codes per byte, `pack_int4`'s layout) and "...up_proj.scales" (float32).
Loading replaces those Linear layers of a freshly built float model by empty
`QuantizedLinear`s and copies the stored tensors in unchanged, so codes and scales
round-trip bit for bit. Pruned models need nothing special (their zeros are stored
densely); the summary still records the run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
from torch import nn

from decodekit.models.qlinear import QuantizedEmbedding, QuantizedLinear

METADATA_KEY = "decodekit.compression"
CHECKPOINT_FORMAT = 1
COMPRESSION_FILE = "compression.json"
WEIGHTS_FILE = "model.compressed.safetensors"
DIRECTORY_FORMAT = 1


def read_compression_config(path: str | Path) -> dict[str, Any] | None:
    """The JSON compression config of a checkpoint, or None for a plain safetensors file."""
    with safetensors.safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    text = metadata.get(METADATA_KEY)
    if text is None:
        return None
    config = json.loads(text)
    if config.get("format") != CHECKPOINT_FORMAT:
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
        model.set_submodule(
            name,
            QuantizedLinear(
                spec["in_features"],
                spec["out_features"],
                spec["bits"],
                spec["group_size"],
                spec["bias"],
                offsets=spec.get("offsets", False),
                activation_bits=spec.get("activation_bits"),  # absent from checkpoints before it: weight-only
            ),
        )
    head = getattr(model, "lm_head", None)
    if isinstance(head, QuantizedLinear) and isinstance(getattr(model, "embed_tokens", None), nn.Embedding):
        with safetensors.safe_open(str(path), "pt") as stored:
            held = "embed_tokens.weight" in stored.keys()  # noqa: SIM118 (safe_open is no dict)
        if not held:  # a tied embedding on the head's grid (compress/apply.py `quantize_head`)
            model.embed_tokens = QuantizedEmbedding(head, model.embed_tokens.weight.dtype)
    missing, unexpected = safetensors.torch.load_model(model, str(path), strict=True)
    assert not missing and not unexpected
    return config


def read_marker(path: str | Path) -> dict[str, Any]:
    marker = json.loads((Path(path) / COMPRESSION_FILE).read_text())
    if marker.get("format") != DIRECTORY_FORMAT:
        raise ValueError(
            f"{str(path)!r}: unsupported compressed directory format {marker.get('format')!r}"
        )
    return marker


def load_compressed_dir(path: str | Path, name: str | None = None) -> Any:
    """The NativeLM stored in a directory written by `save_compressed_dir`."""
    from decodekit.models.checkpoint import eos_token_ids, load_tokenizer, read_config
    from decodekit.models.native import LlamaNet, NativeLM, transpose_weight_layout
    from decodekit.models.native_config import NativeConfig

    path = Path(path)
    marker = read_marker(path)
    config = read_config(path)
    parsed = NativeConfig.from_dict(config)
    with torch.device("meta"):
        net = LlamaNet(parsed)  # no random initialisation: every tensor is loaded below
    net = net.to_empty(device="cpu")
    if parsed.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight
    load_compressed(net, path / marker["weights"])
    transpose_weight_layout(net)  # the float Linear layers as `NativeLM.from_pretrained` lays them out
    tokenizer = load_tokenizer(path)
    return NativeLM(
        net,
        parsed,
        name=name or path.name,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(path, config, tokenizer),
    )
