"""Int8 storage of a checkpoint's weights: how a shipped model stays small on disk.

A shipped model that must decode in float32 (a memory-bound target on a CPU with no native
bfloat16) can still be stored at about a quarter of float32's size: every matrix as int8 codes
with one float16 scale per `group_size` (128) consecutive columns of a row (symmetric, scale =
max|w| / 127 over the group: 8.125 bits a weight), every vector (norms) in float32. `load_safetensors`
(models/checkpoint.py) dequantises such a checkpoint to float32 as it reads it, so the model
loads like any other; the rounding is the storage's only cost (MODELS.md gives its perplexity).

On disk: safetensors shards named by model.safetensors.index.json (as Hugging Face shards
them), a matrix `name` stored as `name` (int8) beside `name` + SCALE_SUFFIX (float32).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SCALE_SUFFIX = ".int8_group_scales"


def quantise(weight: torch.Tensor, group_size: int,
             scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [rows, cols], scales [rows, cols / group_size] in `scale_dtype`) of a
    matrix; the codes are rounded against the stored (rounded) scales."""
    rows, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"group_size {group_size} does not divide the {cols} columns of a matrix")
    groups = weight.detach().float().reshape(rows, cols // group_size, group_size)
    scales = (groups.abs().amax(dim=-1) / 127).to(scale_dtype)
    divisor = scales.float().clamp(min=torch.finfo(scale_dtype).tiny).unsqueeze(-1)
    codes = torch.round(groups / divisor).clamp(-127, 127)
    return codes.to(torch.int8).reshape(rows, cols), scales


def dequantise_tensor(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows, cols = codes.shape
    group_size = cols // scales.shape[1]
    groups = codes.float().reshape(rows, scales.shape[1], group_size) * scales.float().unsqueeze(-1)
    return groups.reshape(rows, cols)


def save(state: dict[str, torch.Tensor], folder: str | Path, group_size: int = 128,
         shard_bytes: int = 15 * 2**20, scale_dtype: torch.dtype = torch.float16) -> list[Path]:
    """Write `state` (a model's state dict) as int8 shards of at most `shard_bytes` each (a
    tensor larger than that gets a shard of its own) and their index; returns the shards."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if tensor.dim() == 2 and tensor.is_floating_point():
            group = group_size if tensor.shape[1] % group_size == 0 else tensor.shape[1]  # else per row
            stored[name], stored[name + SCALE_SUFFIX] = quantise(tensor, group, scale_dtype)
        else:
            stored[name] = tensor.detach().float().contiguous() if tensor.is_floating_point() else tensor
    shards: list[dict[str, torch.Tensor]] = [{}]
    for name, tensor in stored.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and sum(t.numel() * t.element_size() for t in shards[-1].values()) + size > shard_bytes:
            shards.append({})
        shards[-1][name] = tensor.cpu().contiguous()
    paths, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        path = folder / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path, metadata={"format": "pt", "decodekit_storage": "int8"})
        paths.append(path)
        weight_map.update(dict.fromkeys(shard, path.name))
    total = sum(t.numel() * t.element_size() for t in stored.values())
    index = {"metadata": {"total_size": total, "decodekit_storage": f"int8, groups of {group_size}"},
             "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    return paths


def is_int8_storage(folder: Path) -> bool:
    """Whether `folder`'s weights are stored by `save` (its index says so)."""
    index = folder / "model.safetensors.index.json"
    return index.exists() and "decodekit_storage" in json.loads(index.read_text()).get("metadata", {})


def dequantise(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with every int8-stored matrix back in float32 (other tensors unchanged)."""
    scaled = {name[: -len(SCALE_SUFFIX)] for name in state if name.endswith(SCALE_SUFFIX)}
    if not scaled:
        return state
    return {name: dequantise_tensor(tensor, state[name + SCALE_SUFFIX]) if name in scaled else tensor
            for name, tensor in state.items() if not name.endswith(SCALE_SUFFIX)}


def main(argv: list[str] | None = None) -> None:
    """python -m decodekit.models.int8_storage SRC DST [--group-size N]: a checkpoint
    directory's weights as int8 shards in DST, with its config and tokenizer files."""
    import argparse
    import shutil

    from decodekit.models.checkpoint import load_safetensors

    parser = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args(argv)
    src, dst = Path(args.src), Path(args.dst)
    for path in save(load_safetensors(src), dst, args.group_size):
        print(path, path.stat().st_size)
    for path in src.iterdir():
        if path.suffix == ".json" and not path.name.startswith("model.safetensors"):
            shutil.copyfile(path, dst / path.name)


if __name__ == "__main__":
    main()
