"""Long prompts for `bench speculative --clients N --prompt-tokens P` (issue 36: seed 001's claim
that speculative decoding "can harm throughput at low context but improves both throughput and
latency at long context lengths", after MagicDec, Chen et al. 2024).

- `context_prompts`: `count` prompts of exactly `tokens` token ids, windows spread evenly over
  the shipped validation text (overlapping when count x tokens exceeds it: their starts
  differ, so no two share a prefix-cache block);
- `context_engine_config`: an engine whose block pool holds every request's prompt and
  generated tokens at once, and keeps the draft's pool (and its prefix cache) between calls,
  so a timed run decodes rather than prefills: the prompts' KV is computed once, in the
  untimed reference run, for the target and the draft alike;
- `rope_scaled_copy`: a checkpoint directory that is the model's with a larger RoPE base in
  its config.json, its weight files linked: how a 512-position model is read at 2,000+
  positions without retraining.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from decodekit.compress.evaluate import HELD_OUT
from decodekit.engine.config import EngineConfig


def context_prompts(model, count: int, tokens: int) -> list[list[int]]:
    """`count` windows of `tokens` token ids of the validation text, their starts spread evenly
    over it. ValueError when the text is shorter than one window."""
    ids = model.encode(HELD_OUT["val"].read_text())
    if tokens > len(ids):
        raise ValueError(f"prompt_tokens must be at most {len(ids)} (the validation text's tokens), "
                         f"got {tokens}")  # fmt: skip
    room = len(ids) - tokens
    starts = [i * room // max(count - 1, 1) for i in range(count)] if count > 1 else [0]
    return [ids[start : start + tokens] for start in starts]


def check_context(models, prompt_tokens: int, new_tokens: int, gamma: int) -> None:
    """ValueError unless a prompt of `prompt_tokens`, its `new_tokens` and a draft of `gamma`
    past them fit every model's context (a row stops at its model's context, short of the
    tokens the benchmark counts)."""
    needed = prompt_tokens + new_tokens + gamma
    for model in models:
        limit = getattr(model, "max_context", None)
        if limit is not None and needed > limit:
            raise ValueError(
                f"prompt_tokens + new_tokens + gamma = {prompt_tokens} + {new_tokens} + {gamma} = {needed} "
                f"is past {model.name}'s context of {limit} positions (a RoPE-scaled copy reaches "
                "further: benchmarks/speculative_long_context.py)"
            )


def context_engine_config(concurrent: int, positions: int, block_size: int = 16) -> EngineConfig:
    """An engine for `concurrent` sequences of up to `positions` positions each: its pool holds
    all of them running (each with a partial block) and their prompts cached, a quarter more
    for the blocks a rejected draft leaves; the draft's pool of the same number of blocks is
    kept when idle (idle_member_bytes), so its prefix cache serves the next timed run too. The
    eager step (compile=False): a background compilation would run during the timed runs,
    and for plain decoding only (verification steps are not decode-only)."""
    blocks = math.ceil(1.25 * EngineConfig(block_size=block_size).blocks_holding(concurrent, positions))
    return EngineConfig(block_size=block_size, num_blocks=blocks, max_running=max(concurrent, 1024),
                        compile=False, idle_member_bytes=2**50)  # fmt: skip


def rope_scaled_copy(
    source: str | os.PathLike, into: str | os.PathLike, theta_factor: float = 16.0, positions: int = 2304
) -> Path:
    """`into`/<name>-theta<k>: `source`'s checkpoint (an embedded name or a directory) with its
    RoPE base rope_theta multiplied by `theta_factor` and max_position_embeddings `positions`;
    every other file a symbolic link to the original, which is never written.

    A larger base stretches every rotation's wavelength (NTK-aware scaling, bloc97 2023; Code
    Llama's longer context), so positions past the training length look like near ones. Of the
    untrained scalings it is the one that keeps speculative decoding exact: its frequencies
    are fixed, where dynamic NTK's depend on the length in each forward (a γ + 1 token
    verification rotates other frequencies than γ + 1 single steps, and greedy tokens differ),
    and linear interpolation (position / factor) leaves these models far worse (BENCHMARKS.md,
    issue 36)."""
    from decodekit.models.registry import resolve

    if not (isinstance(theta_factor, int | float) and theta_factor > 0):
        raise ValueError(f"theta_factor must be a number > 0, got {theta_factor!r}")
    name, path, kind = resolve(source)
    if kind != "hf" or not (path / "config.json").exists():
        raise ValueError(f"{source!r} is not a checkpoint directory with a config.json (kind {kind!r})")
    config = json.loads((path / "config.json").read_text())
    rope = dict(config.get("rope_parameters") or {"rope_type": "default"})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"{source!r} already scales its RoPE ({rope}); rope_scaled_copy starts from "
                         "the default kind")  # fmt: skip
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta * theta_factor}
    config.pop("rope_theta", None)
    config["max_position_embeddings"] = positions
    out = Path(into) / f"{name}-theta{theta_factor:g}"
    out.mkdir(parents=True, exist_ok=True)
    for item in path.iterdir():
        if item.name != "config.json" and not (out / item.name).exists():
            (out / item.name).symlink_to(item.resolve())
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
