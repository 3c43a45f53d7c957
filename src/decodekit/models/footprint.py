"""How much memory a model and its KV cache need, from config.json and the safetensors headers.

Seed 001 ("KV cache" memory): batch · n_ctx · 2 · n_layer · n_heads · head_dim · n_bytes.
With grouped-query attention only the key/value heads are cached, so n_heads there is
`num_key_value_heads` (Llama 2 70B, Mistral, Qwen: several query heads share one); the seed's
formula with the query heads overstates such a cache by num_heads / num_kv_heads. The cache
keeps every position, sliding-window layers included (models/contiguous_kv.py): the formula is the
dense cache's bytes at a capacity of n_ctx (it doubles its capacity when full, so a cache
grown token by token holds up to 2x), and the paged engine rounds each sequence up to whole
blocks. An int8
cache counts one byte per value: its scales (per head and position) are left out.

Weights are counted from the checkpoint's safetensors headers without reading the tensors:
parameters x the bytes of the dtype they load in (a compressed directory's integer codes
and scales as stored). A compressed model that runs on PyTorch's packed CPU kernels
(models/qlinear.py) holds their copies on top, which this count leaves out: int8 layers
2 bytes a row (bf16 scales), int4 layers about 0.5 bytes a weight (the kernel's layout).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from decodekit.validate import check_int

KV_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# safetensors dtype codes -> bytes per element
STORED_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1}


def kv_cache_bytes(batch_size: int, context: int, num_layers: int, num_kv_heads: int, head_dim: int,
                   bytes_per_value: int) -> int:
    """batch · n_ctx · 2 (keys and values) · n_layer · n_kv_heads · head_dim · n_bytes (seed 001)."""
    return batch_size * context * 2 * num_layers * num_kv_heads * head_dim * bytes_per_value


def attention_shape(config: dict[str, Any]) -> dict[str, int]:
    """Layers, KV heads, head size and context of a config.json (NativeLM's reading where it
    supports the architecture: RoPE scaling stretches the context); another decoder's names
    through transformers' attribute map of its model_type (GPT-2's n_head, n_layer, n_embd)."""
    from decodekit.models.native import NativeLM
    from decodekit.models.native_config import NativeConfig

    if NativeLM.supports(config):
        c = NativeConfig.from_dict(config)
        return {"num_layers": c.num_layers, "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads,
                "head_dim": c.head_dim, "max_context": c.context_length}
    aliases = attribute_map(config.get("model_type"))

    def value(name: str):  # config.json's own value: never a default of transformers' class
        found = config.get(name, config.get(aliases.get(name, name)))
        return found if isinstance(found, int) and not isinstance(found, bool) else None

    required = ("num_hidden_layers", "num_attention_heads", "hidden_size")
    missing = [name for name in required if value(name) is None]
    if missing:
        raise ValueError(f"config.json has no {missing[0]!r} (nor the name model_type "
                         f"{config.get('model_type')!r} gives it in transformers, as GPT-2's n_head): "
                         "not a transformer decoder whose KV cache this can size")
    heads = value("num_attention_heads")
    return {"num_layers": value("num_hidden_layers"), "num_heads": heads,
            "num_kv_heads": value("num_key_value_heads") or heads,
            "head_dim": value("head_dim") or value("hidden_size") // heads,
            "max_context": value("max_position_embeddings") or 0}


def attribute_map(model_type: str | None) -> dict[str, str]:
    """transformers' common config names -> this model_type's spelling (GPT-2: num_attention_heads
    -> n_head, num_hidden_layers -> n_layer, hidden_size -> n_embd, max_position_embeddings ->
    n_positions), read from its config class locally; {} for a model_type it does not know."""
    from transformers import CONFIG_MAPPING

    try:
        return dict(CONFIG_MAPPING[model_type].attribute_map)
    except KeyError:
        return {}


def stored_tensors(path: Path, names: bool = False) -> list[tuple]:
    """(safetensors dtype, element count) of every tensor of the directory's weights, headers
    only; `names`: (name, dtype, element count)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = [f for f in (path / "model.safetensors", path / "model.compressed.safetensors") if f.exists()]
    if not files:
        raise FileNotFoundError(f"no model.safetensors (or its index) in {path}")
    tensors = []
    for file in files:
        with safe_open(file, "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is no dict)
                piece = f.get_slice(key)
                count = 1
                for size in piece.get_shape():
                    count *= size
                tensors.append((key, piece.get_dtype(), count) if names else (piece.get_dtype(), count))
    return tensors


def is_linear_weight(name: str) -> bool:
    """A checkpoint's linear layer weight (NativeLM's q/k/v/o, gate/up/down and output head):
    what half weights keep in their stored type (half_linear.py `keep_half_weights`)."""
    return name.endswith("_proj.weight") or name.endswith("lm_head.weight")


def available_memory() -> tuple[int | None, str]:
    """(bytes, source) of the memory available to a new allocation: psutil's, else
    /proc/meminfo's MemAvailable, else (None, why)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.virtual_memory().available), "psutil.virtual_memory().available"
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "/proc/meminfo MemAvailable"
    except OSError:
        pass
    return None, "unknown: no psutil and no /proc/meminfo MemAvailable on this system"


def gguf_weights(path: Path, dtype: str) -> tuple[dict[str, Any], str, int, int | None]:
    """(config.json dict, weights' dtype, weight bytes, parameters or None) of a GGUF file:
    float tensors load in the weights' dtype ("auto" from the file's float type), block types
    as integer codes of about their bytes in the file (int4 layers also hold the kernel's copy
    of theirs: models/gguf_model.py); a file with block types has no float parameter count."""
    from decodekit.models.gguf_model import gguf_config, half_weights, read_gguf, stored_dtype
    from decodekit.models.registry import resolve_dtype

    meta, tensors = read_gguf(path)
    weights_dtype = str(resolve_dtype(dtype, {"dtype": stored_dtype(tensors)})).removeprefix("torch.")
    floats = [int(t.n_elements) for t in tensors.values() if t.tensor_type.name in ("F32", "F16", "BF16")]
    blocks = [int(t.n_bytes) for t in tensors.values() if t.tensor_type.name not in ("F32", "F16", "BF16")]
    weight_bytes = sum(floats) * DTYPE_BYTES[weights_dtype] + sum(blocks)
    if half_weights(dtype, tensors) is not None:
        # the f16 / bf16 matrices but the embedding stay as stored (gguf_model.py `load_gguf`)
        tied = "output.weight" not in tensors  # a tied embedding is the head's half weight too
        kept = sum(int(t.n_elements) for name, t in tensors.items()
                   if len(t.shape) == 2 and (tied or name != "token_embd.weight")
                   and t.tensor_type.name in ("F16", "BF16"))  # fmt: skip
        weight_bytes -= kept * (DTYPE_BYTES[weights_dtype] - 2)
    return gguf_config(meta, tensors, str(path)), weights_dtype, weight_bytes, None if blocks else sum(floats)


def plan_memory(name_or_path: str, context: int, batch_size: int = 1, kv_dtype: str = "auto",
                dtype: str = "auto") -> dict[str, Any]:
    """Weight and KV-cache bytes of serving `batch_size` sequences of `context` positions, and
    whether they fit in the memory available now. kv_dtype "auto": the weights' dtype."""
    from decodekit.models.checkpoint import read_config
    from decodekit.models.registry import half_weights_dtype, resolve, resolve_dtype

    check_int("context", context, 1)
    check_int("batch_size", batch_size, 1)
    if kv_dtype != "auto" and kv_dtype not in KV_BYTES:
        allowed = ", ".join(map(repr, ("auto", *KV_BYTES)))
        raise ValueError(f"kv_dtype must be one of {allowed}, got {kv_dtype!r}")
    name, path, kind = resolve(name_or_path)
    if kind not in ("hf", "compressed", "gguf"):
        raise ValueError(f"model {name!r} ({kind}) has no KV cache to size: give a transformer "
                         "checkpoint")
    gguf = gguf_weights(path, dtype) if kind == "gguf" else None
    config = gguf[0] if gguf else read_config(path)
    shape = attention_shape(config)
    if shape["max_context"] and context > shape["max_context"]:
        raise ValueError(f"context must be <= {shape['max_context']} (the context of model {name!r}), "
                         f"got {context}")
    tensors = [] if gguf else stored_tensors(path)
    parameters = None if kind == "compressed" else sum(count for _, count in tensors)
    if gguf:
        _, weights_dtype, weight_bytes, parameters = gguf
    elif kind == "compressed":
        if dtype not in ("auto", "float32"):
            raise ValueError(f"compressed model {name!r} runs in float32 only, got dtype {dtype!r}")
        weights_dtype = "float32"
        weight_bytes = sum(count * STORED_BYTES[code] for code, count in tensors)
    else:
        weights_dtype = str(resolve_dtype(dtype, config)).removeprefix("torch.")
        weight_bytes = sum(count for _, count in tensors) * DTYPE_BYTES[weights_dtype]
        if half_weights_dtype(dtype, config) is not None:  # linear weights kept as stored (2 bytes)
            tied = config.get("tie_word_embeddings", False)  # the lookup then reads the head's half weight
            kept = sum(count for name, _, count in stored_tensors(path, names=True)
                       if (is_linear_weight(name) and not (tied and name.endswith("lm_head.weight")))
                       or (tied and name.endswith("embed_tokens.weight")))
            weight_bytes -= kept * (DTYPE_BYTES[weights_dtype] - 2)
    kv_dtype = weights_dtype if kv_dtype == "auto" else kv_dtype
    kv_bytes = kv_cache_bytes(batch_size, context, shape["num_layers"], shape["num_kv_heads"],
                              shape["head_dim"], KV_BYTES[kv_dtype])
    available, source = available_memory()
    total = weight_bytes + kv_bytes
    return {
        # a compressed directory's stored elements (int4 codes two to a byte, scales) are no
        # parameter count
        "model": name, "parameters": parameters,
        "dtype": weights_dtype,
        "weight_bytes": weight_bytes, "kv_dtype": kv_dtype, "context": context, "batch_size": batch_size,
        **shape,
        "kv_formula": f"{batch_size} x {context} x 2 x {shape['num_layers']} layers x "
                      f"{shape['num_kv_heads']} KV heads x {shape['head_dim']} x {KV_BYTES[kv_dtype]} bytes",
        "kv_bytes": kv_bytes, "total_bytes": total, "available_bytes": available,
        "available_source": source, "fits": None if available is None else total <= available,
    }
