"""Reading a Hugging Face checkpoint directory without transformers' model classes.

config.json, model.safetensors (or shards named by model.safetensors.index.json),
generation_config.json and tokenizer files. Nothing here downloads: every path is local.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def read_config(path: Path) -> dict[str, Any]:
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no config.json in {path}")
    return json.loads((path / "config.json").read_text())


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards named by its index; matrices stored
    as int8 (models/int8_storage.py) come back in float32."""
    from safetensors.torch import load_file

    from decodekit.models.int8_storage import dequantise

    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.exists():
        return load_file(single)
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(path / shard))
        return dequantise(state)
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def load_tokenizer(path: Path) -> Any | None:
    """The directory's tokenizer, or None if it has no tokenizer files: a `FastTokenizer`
    (models/tokenizer.py: tokenizer.json without importing transformers) where that computes
    what transformers would, else transformers' AutoTokenizer."""
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        return None
    from decodekit.models.tokenizer import FastTokenizer

    fast = FastTokenizer.from_directory(path)
    if fast is not None:
        return fast
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def eos_token_ids(path: Path, config: dict[str, Any], tokenizer: Any | None) -> tuple[int, ...]:
    """EOS ids of generation_config.json, config.json and the tokenizer, deduplicated
    (the same order as `hf.eos_token_ids`)."""
    sources: list[Any] = []
    generation = path / "generation_config.json"
    if generation.exists():
        sources.append(json.loads(generation.read_text()).get("eos_token_id"))
    sources.append(config.get("eos_token_id"))
    sources.append(getattr(tokenizer, "eos_token_id", None))
    found: list[int] = []
    for value in sources:
        for token in value if isinstance(value, list | tuple) else [value]:
            if token is not None and int(token) not in found:
                found.append(int(token))
    return tuple(found)
