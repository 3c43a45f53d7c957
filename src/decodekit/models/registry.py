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

from decodekit.models.base import LanguageModel

ASSETS = Path(__file__).parent / "assets"
DEFAULT_MODEL = "shakespeare"


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


def load_model(name_or_path: str | Path = DEFAULT_MODEL, backend: str = "auto") -> LanguageModel:
    """Load an embedded model by name or a local checkpoint directory.

    backend: "auto" (our native forward when the architecture is supported, else
    transformers), "native" or "hf".
    """
    if backend not in ("auto", "native", "hf"):
        raise ValueError(f"backend must be 'auto', 'native' or 'hf', got {backend!r}")
    name, path, kind = resolve(name_or_path)
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
    if backend in ("auto", "native"):
        try:
            from decodekit.models.native import NativeLM
        except ImportError:
            NativeLM = None
        if NativeLM is not None and NativeLM.supports(config):
            return NativeLM.from_pretrained(path, name=name)
        if backend == "native":
            raise ValueError(
                f"model {name!r} (model_type {config.get('model_type')!r}) is not supported by the "
                "native backend; use backend='hf'"
            )
    from decodekit.models.hf import HFModelLM

    return HFModelLM.from_pretrained(path, name=name)
