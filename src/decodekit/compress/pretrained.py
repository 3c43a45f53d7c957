"""Writing compressed model directories: what `decodekit compress --out DIR` writes. Their
layout, and reading them (`load_model(DIR)`: `load_compressed_dir`), are
models/compressed.py's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from decodekit.compress.apply import CompressionSummary
from decodekit.compress.checkpoint import save_compressed
from decodekit.models.compressed import COMPRESSION_FILE, DIRECTORY_FORMAT, WEIGHTS_FILE

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
        "format": DIRECTORY_FORMAT,
        "weights": WEIGHTS_FILE,
        "base": lm.name,
        "summary": summary.to_dict() if summary is not None else None,
    }
    (out / COMPRESSION_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return out
