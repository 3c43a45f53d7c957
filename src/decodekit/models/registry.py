"""`load_model(name_or_path)`: an embedded model by name, a local checkpoint directory, or a
local GGUF file (models/gguf_model.py).

Embedded models live in `models/assets/` and are listed in `assets/registry.json`
(a dict keyed by name: directory, kind, description and measured figures). No
code path here downloads anything: an unknown name that is not an existing
directory is a `ValueError`, never a hub lookup.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import torch

from decodekit.models.base import LanguageModel

ASSETS = Path(__file__).parent / "assets"
DEFAULT_MODEL = "shakespeare"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ("auto", "cpu", "cuda", "mps")


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """The torch device of `device`: "auto" (CUDA where available, else the CPU), "cpu",
    "cuda" (or "cuda:N"), "mps", or a torch.device. ValueError for an unknown name or a
    device this machine does not have."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    if not isinstance(device, str | torch.device) or kind not in DEVICES[1:]:
        names = ", ".join(repr(n) for n in DEVICES)
        raise ValueError(f"device must be one of {names} (or 'cuda:N'), got {device!r}")
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"device {device!r} is not a valid device name: {error}") from None
    available = {"cpu": lambda: True, "cuda": torch.cuda.is_available,
                 "mps": torch.backends.mps.is_available}  # fmt: skip
    if not available[kind]():
        raise ValueError(f"device {device!r} is not available on this machine (available: 'cpu'"
                         f"{', ' + repr('cuda') if torch.cuda.is_available() else ''})")  # fmt: skip
    if kind == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA devices")
    return resolved


def resolve_dtype(
    dtype: str | torch.dtype, config: dict | None = None, device: str | torch.device = "cpu"
) -> torch.dtype:
    """The torch dtype of `dtype`: a name of DTYPES, one of its values, or "auto".

    "auto" keeps the checkpoint's `dtype`/`torch_dtype` (config.json; float32 where it names
    none) where that is fast: on an accelerator always. On the CPU a float32 checkpoint stays
    float32 (never lowered), a float16 one becomes float32 (float16 decodes at 0.57x float32
    on the CPU), and a bfloat16 one stays bfloat16 only where a short probe of this machine
    (models/dtype_probe.py, cached on disk) finds bfloat16 decoding at least as fast as
    float32 through decodekit's own linear path: on AMX machines (1.5x); on an AMD Zen 5
    with AVX-512-BF16 but no AMX with decodekit's GEMV kernels (1.4x), not on PyTorch's path
    alone (0.72-0.76x). `dtype_probe.dtype_report()` (and `decodekit models`) shows the
    verdict and its timings. Where a half checkpoint runs in float32 this way, its linear
    weights stay as stored (`half_weights_dtype`).
    """
    if isinstance(dtype, str) and dtype == "auto":
        chosen = config_dtype(config)
        if torch.device(device).type != "cpu" or chosen == torch.float32:
            return chosen
        if chosen == torch.float16:
            return torch.float32
        from decodekit.models.dtype_probe import cpu_bfloat16_dtype

        return cpu_bfloat16_dtype()
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    names = ", ".join(repr(n) for n in ("auto", *DTYPES))
    raise ValueError(f"dtype must be one of {names} (or the torch dtype), got {dtype!r}")


def config_dtype(config: dict | None) -> torch.dtype:
    """A config.json's `dtype` / `torch_dtype` (float32 where it names none or an unknown one)."""
    stored = (config or {}).get("dtype") or (config or {}).get("torch_dtype") or "float32"
    return DTYPES.get(str(stored).removeprefix("torch."), torch.float32)


def half_weights_dtype(
    dtype: str | torch.dtype, config: dict | None = None, device: str | torch.device = "cpu"
) -> torch.dtype | None:
    """Where "auto" runs a bfloat16 or float16 checkpoint in float32 on the CPU (`resolve_dtype`)
    and decodekit's kernels are built: the dtype its linear layers' weights keep, as stored
    (half_linear.py `keep_half_weights`: the float32 model's products, half its weight bytes, a
    decode step streaming half as much); else None. An explicit "float32" widens every weight."""
    if not (isinstance(dtype, str) and dtype == "auto") or torch.device(device).type != "cpu":
        return None
    half = config_dtype(config)
    if half not in (torch.bfloat16, torch.float16) or resolve_dtype(dtype, config, device) != torch.float32:
        return None
    from decodekit.models import kernels

    return half if kernels.available() else None


@cache
def embedded_models() -> dict[str, dict]:
    """Name -> registry entry of every model shipped with the package."""
    path = ASSETS / "registry.json"
    if not path.exists():
        return {}
    entries = json.loads(path.read_text())
    return {name: entry for name, entry in entries.items() if (ASSETS / entry["dir"]).exists()}


def default_draft(name: str) -> str | None:
    """The embedded draft model of an embedded target: its registry entry's "draft", else the
    embedded `<name>-draft`; None where there is neither."""
    models = embedded_models()
    draft = models.get(name, {}).get("draft", f"{name}-draft")
    return draft if draft in models else None


# A hub ID as Hugging Face spells it ("Qwen/Qwen2.5-0.5B"): one slash, no leading "." or "~".
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve(name_or_path: str | Path) -> tuple[str, Path, str]:
    """(name, directory or file, kind) of an embedded name, a local directory or a GGUF file."""
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
        from decodekit.models.gguf_model import is_gguf

        if is_gguf(path) or path.suffix == ".gguf":  # a .gguf that is not GGUF: read_gguf says why
            return path.stem, path, "gguf"
        raise ValueError(f"model path {text!r} is a file but not a GGUF file; expected a checkpoint "
                         "directory or a .gguf file")
    if HUB_ID.fullmatch(text):  # "org/name": a Hugging Face hub ID, not a directory here
        local = "./" + text.rsplit("/", 1)[1]
        raise ValueError(
            f"model {text!r} is not a local directory and looks like a Hugging Face hub ID: nothing is "
            f"downloaded; fetch it first (huggingface-cli download {text} --local-dir {local}) "
            f"and give the directory ({local})"
        )
    looks_like_path = "/" in text or text.startswith(".") or text.startswith("~")
    if looks_like_path:
        raise ValueError(f"model path {text!r} does not exist")
    raise ValueError(
        f"unknown model {text!r}: not an embedded model ({', '.join(sorted(models)) or 'none'}) "
        "and not a local directory"
    )


def load_model(
    name_or_path: str | Path = DEFAULT_MODEL,
    backend: str = "auto",
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
) -> LanguageModel:
    """Load an embedded model by name, a local checkpoint directory or a GGUF file.

    backend: "auto" (our native forward when the architecture is supported, else
    transformers), "native" or "hf". dtype: of the weights, activations and KV cache:
    "float32", "bfloat16", "float16" or "auto" (the checkpoint's where it is fast, float32
    for the shipped models; the rule, a measurement of this CPU for bfloat16 checkpoints, is
    `resolve_dtype`'s); the logits are float32 whatever
    it is. device: "cpu" (the default), "cuda", "mps" or "auto" (CUDA where available):
    activations, KV cache and logits live there too. N-gram models run on the CPU in
    float32; compressed models in float32. A GGUF file runs on the native backend; "auto"
    starts from its float tensors' type (models/gguf_model.py).
    """
    if backend not in ("auto", "native", "hf"):
        raise ValueError(f"backend must be 'auto', 'native' or 'hf', got {backend!r}")
    resolve_dtype(dtype)  # a bad value fails before anything is read
    torch_device = resolve_device(device)
    name, path, kind = resolve(name_or_path)
    if kind in ("ngram", "compressed") and resolve_dtype(dtype) != torch.float32:
        raise ValueError(f"{kind} model {name!r} runs in float32 only, got dtype {dtype!r}")
    if kind == "ngram" and torch_device.type != "cpu":
        raise ValueError(f"n-gram model {name!r} runs on the CPU only, got device {device!r}")
    if kind == "reward":
        raise ValueError(
            f"{name!r} is a reward model, not a language model: load it with "
            "decodekit.meta.rewards.load_reward_model (or meta.tasks.arith.load_orm/load_prm)"
        )
    if kind == "ngram":
        from decodekit.models.ngram import NGramLM

        return NGramLM.load(path)
    if kind == "gguf":
        if backend == "hf":
            raise ValueError(f"GGUF model {name!r} runs on the native backend only, got backend='hf'")
        from decodekit.models.gguf_model import load_gguf

        return load_gguf(path, dtype=dtype, name=name, device=torch_device)
    if kind == "compressed":
        if backend == "hf":
            raise ValueError(f"compressed model {name!r} runs on the native backend only")
        from decodekit.models.compressed import load_compressed_dir

        return load_compressed_dir(path, name=name).to(torch_device)
    if not (path / "config.json").exists():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    config = json.loads((path / "config.json").read_text())
    torch_dtype = resolve_dtype(dtype, config, torch_device)
    if backend in ("auto", "native"):
        try:
            from decodekit.models.native import NativeLM
        except ImportError:
            NativeLM = None
        if NativeLM is not None and NativeLM.supports(config):
            model = NativeLM.from_pretrained(path, dtype=torch_dtype, name=name, device=torch_device)
            half = half_weights_dtype(dtype, config, torch_device)
            if half is not None:
                from decodekit.models.half_linear import keep_half_weights

                keep_half_weights(model.net, half)
            return model
        if backend == "native":
            raise ValueError(
                f"model {name!r} (model_type {config.get('model_type')!r}) is not supported by the "
                "native backend; use backend='hf'"
            )
    from decodekit.models.hf import HFModelLM

    return HFModelLM.from_pretrained(path, name=name, dtype=torch_dtype, device=torch_device)
