"""`load_model(name_or_path)`: an embedded model by name, or a local checkpoint directory.

Embedded models live in `models/assets/` and are listed in `assets/registry.json`
(a dict keyed by name: directory, kind, description and measured figures). No
code path here downloads anything: an unknown name that is not an existing
directory is a `ValueError`, never a hub lookup.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch

from decodekit.models.base import LanguageModel

ASSETS = Path(__file__).parent / "assets"
DEFAULT_MODEL = "shakespeare"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, config: dict | None = None) -> torch.dtype:
    """The torch dtype of `dtype`: a name of DTYPES, one of its values, or "auto" (the
    checkpoint's `dtype`/`torch_dtype` in config.json; float32 where it names none)."""
    if dtype == "auto":
        stored = (config or {}).get("dtype") or (config or {}).get("torch_dtype") or "float32"
        return DTYPES.get(str(stored).removeprefix("torch."), torch.float32)
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    names = ", ".join(repr(n) for n in ("auto", *DTYPES))
    raise ValueError(f"dtype must be one of {names} (or the torch dtype), got {dtype!r}")


@cache
def embedded_models() -> dict[str, dict]:
    """Name -> registry entry of every model shipped with the package."""
    path = ASSETS / "registry.json"
    if not path.exists():
        return {}
    entries = json.loads(path.read_text())
    return {name: entry for name, entry in entries.items() if (ASSETS / entry["dir"]).exists()}


def resolve(name_or_path: str | Path) -> tuple[str, Path, str]:
    """(name, directory, kind) of an embedded name or a local directory."""
    text = str(name_or_path)
    models = embedded_models()
    if text in models:
        entry = models[text]
        return text, ASSETS / entry["dir"], entry.get("kind", "hf")
    path = Path(text).expanduser()
    if path.is_dir():
        kind = "ngram" if (path / "ngram.json").exists() else "hf"
        if (path / "compression.json").exists():
            kind = "compressed"  # written by `decodekit compress` (models/compressed.py)
        return path.name, path, kind
    if path.exists():
        raise ValueError(f"model path {text!r} is a file; expected a checkpoint directory")
    looks_like_path = "/" in text or text.startswith(".") or text.startswith("~")
    if looks_like_path:
        raise ValueError(f"model path {text!r} does not exist")
    raise ValueError(
        f"unknown model {text!r}: not an embedded model ({', '.join(sorted(models)) or 'none'}) "
        "and not a local directory"
    )


def load_model(
    name_or_path: str | Path = DEFAULT_MODEL, backend: str = "auto", dtype: str | torch.dtype = "auto"
) -> LanguageModel:
    """Load an embedded model by name or a local checkpoint directory.

    backend: "auto" (our native forward when the architecture is supported, else
    transformers), "native" or "hf". dtype: of the weights, activations and KV cache
    ("auto": the checkpoint's, float32 for the shipped models; see `resolve_dtype`); the
    logits are float32 whatever it is. N-gram and compressed models run in float32 only.
    """
    if backend not in ("auto", "native", "hf"):
        raise ValueError(f"backend must be 'auto', 'native' or 'hf', got {backend!r}")
    resolve_dtype(dtype)  # a bad value fails before anything is read
    name, path, kind = resolve(name_or_path)
    if kind in ("ngram", "compressed") and resolve_dtype(dtype) != torch.float32:
        raise ValueError(f"{kind} model {name!r} runs in float32 only, got dtype {dtype!r}")
    if kind == "reward":
        raise ValueError(
            f"{name!r} is a reward model, not a language model: load it with "
            "decodekit.meta.rewards.load_reward_model (or meta.tasks.arith.load_orm/load_prm)"
        )
    if kind == "ngram":
        from decodekit.models.ngram import NGramLM

        return NGramLM.load(path)
    if kind == "compressed":
        if backend == "hf":
            raise ValueError(f"compressed model {name!r} runs on the native backend only")
        from decodekit.models.compressed import load_compressed_dir

        return load_compressed_dir(path, name=name)
    if not (path / "config.json").exists():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    config = json.loads((path / "config.json").read_text())
    torch_dtype = resolve_dtype(dtype, config)
    if backend in ("auto", "native"):
        try:
            from decodekit.models.native import NativeLM
        except ImportError:
            NativeLM = None
        if NativeLM is not None and NativeLM.supports(config):
            return NativeLM.from_pretrained(path, dtype=torch_dtype, name=name)
        if backend == "native":
            raise ValueError(
                f"model {name!r} (model_type {config.get('model_type')!r}) is not supported by the "
                "native backend; use backend='hf'"
            )
    from decodekit.models.hf import HFModelLM

    return HFModelLM.from_pretrained(path, name=name, dtype=torch_dtype)
