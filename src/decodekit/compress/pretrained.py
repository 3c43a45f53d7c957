"""Compressed model directories: what `decodekit compress --out DIR` writes and `load_model(DIR)`
reads.

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
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from decodekit.compress.apply import CompressionSummary
from decodekit.compress.checkpoint import load_compressed, save_compressed

COMPRESSION_FILE = "compression.json"
WEIGHTS_FILE = "model.compressed.safetensors"
FORMAT_VERSION = 1
# Everything of a Hugging Face directory except the float weights.
COPIED_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


def is_compressed_dir(path: str | Path) -> bool:
    return (Path(path) / COMPRESSION_FILE).is_file()


def save_compressed_dir(
    lm: Any, out: str | Path, source: str | Path, summary: CompressionSummary | None = None
) -> Path:
    """Write the compressed NativeLM `lm` to directory `out` (created; must be empty or absent).

    `source` is the checkpoint directory `lm` was loaded from: its config and tokenizer
    files are copied next to the compressed weights.
    """
    from decodekit.models.native import NativeLM

    if not isinstance(lm, NativeLM):
        raise TypeError(f"compressed directories hold NativeLM models, got {type(lm).__name__}")
    out, source = Path(out), Path(source)
    if out.resolve() == source.resolve():
        raise ValueError(f"output directory {str(out)!r} is the source model's directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"output directory {str(out)!r} already exists and is not empty")
    config = json.loads((source / "config.json").read_text())
    # NativeLM infers tying from a missing lm_head when config.json is silent; say it.
    config["tie_word_embeddings"] = lm.config.tie_word_embeddings
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in COPIED_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    save_compressed(lm.net, out / WEIGHTS_FILE, summary)
    marker = {
        "format": FORMAT_VERSION,
        "weights": WEIGHTS_FILE,
        "base": lm.name,
        "summary": summary.to_dict() if summary is not None else None,
    }
    (out / COMPRESSION_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return out


def read_marker(path: str | Path) -> dict[str, Any]:
    marker = json.loads((Path(path) / COMPRESSION_FILE).read_text())
    if marker.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"{str(path)!r}: unsupported compressed directory format {marker.get('format')!r}"
        )
    return marker


def load_compressed_dir(path: str | Path, name: str | None = None) -> Any:
    """The NativeLM stored in a directory written by `save_compressed_dir`."""
    from decodekit.models.checkpoint import eos_token_ids, load_tokenizer, read_config
    from decodekit.models.native import LlamaNet, NativeConfig, NativeLM, transpose_weight_layout

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
