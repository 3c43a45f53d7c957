"""`decodekit bench latency`: one forward's time by batch size x new tokens on a filled KV cache.

Seed 000's latency table: scoring gamma tokens in parallel costs about one decoding step while
decoding is memory-bound (reading the weights dominates), which is what makes speculative
decoding pay. For each batch size B and each number of new tokens T, a NativeLM forward of
[B, T] random token ids runs on its dense cache (models/contiguous_kv.py) holding `context` positions,
and the cache is cropped back to `context` after each call. The cached keys and values are
random numbers rather than a prefill's (a forward's time does not depend on their values, and
a 64-row prefill of a large model would cost more than the whole grid). Each cell is the
best of `repeats` timed calls after one untimed call, in CPU time (the process's, which
other jobs on a shared machine disturb less than the wall clock; with one thread it is the
forward's time) and in wall time; `ratio` is its CPU time over the B = 1, T = 1 cell's: about
1 where the forward is bound by reading the weights, about B x T where it is bound by
arithmetic.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from decodekit.bench.decode import machine
from decodekit.models.contiguous_kv import ContiguousKVCache
from decodekit.runtime import progress as progress_bar
from decodekit.validate import check_int

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
NEW_TOKENS = (1, 2, 4, 8, 16)


def filled_cache(model, batch_size: int, context: int, room: int) -> ContiguousKVCache:
    """A cache of `batch_size` rows holding `context` positions of random keys and values."""
    cache = model.new_cache(batch_size)
    if not isinstance(cache, ContiguousKVCache):
        raise ValueError(f"bench latency times NativeLM's dense cache; model {model.name!r} "
                         f"({type(model).__name__}) has none")
    cache.reserve(context + room)
    with torch.inference_mode():
        for side in (cache.keys, cache.values):  # [N, B, H_kv, C, D]
            side[:, :, :, :context] = torch.randn(side[:, :, :, :context].shape, dtype=side.dtype) * 0.5
    cache.append(None, context)
    return cache


@torch.inference_mode()
def time_forward(model, cache: ContiguousKVCache, num_tokens: int, repeats: int) -> tuple[float, float]:
    """Best (CPU, wall) seconds of one forward of `num_tokens` new tokens per row, the cache
    cropped back after each."""
    context = cache.length
    tokens = torch.randint(0, model.vocab_size, (cache.batch_size, num_tokens))
    best_cpu = best_wall = float("inf")
    for i in range(repeats + 1):
        cpu, wall = time.process_time(), time.perf_counter()
        model.forward(tokens, cache)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        cache.crop(context)
        if i:  # the first call warms up (allocations, kernel choice)
            best_cpu, best_wall = min(best_cpu, cpu), min(best_wall, wall)
    return best_cpu, best_wall


def bench_latency(
    model_name: str = "shakespeare",
    batch_sizes: Sequence[int] = BATCH_SIZES,
    new_tokens: Sequence[int] = NEW_TOKENS,
    context: int = 256,
    repeats: int = 3,
    dtype: str = "auto",
    progress: bool = False,
) -> dict:
    """Forward milliseconds for every (batch size, new tokens) cell, and each over the (1, 1) cell."""
    import decodekit as dk

    for name, values in (("batch size", batch_sizes), ("new tokens", new_tokens)):
        if not values:
            raise ValueError(f"{name}s must be a non-empty list of positive integers, got {list(values)}")
        for value in values:
            check_int(name, value, 1)
    check_int("context", context, 1)
    check_int("repeats", repeats, 1)
    model = dk.load_model(model_name, dtype=dtype)
    max_context = getattr(model, "max_context", None)
    if max_context is not None and context + max(new_tokens) > max_context:
        raise ValueError(f"context {context} + {max(new_tokens)} new tokens is past model "
                         f"{model.name!r}'s context of {max_context} positions")
    cells = []
    grid = [(b, t) for b in batch_sizes for t in new_tokens]
    cache = None
    for b, t in progress_bar(grid, total=len(grid), desc="bench latency", enabled=progress):
        if cache is None or cache.batch_size != b:
            cache = filled_cache(model, b, context, max(new_tokens))
        cpu, wall = time_forward(model, cache, t, repeats)
        cells.append({"batch_size": b, "new_tokens": t, "cpu_ms": round(1000 * cpu, 3),
                      "wall_ms": round(1000 * wall, 3)})
    base = next((c["cpu_ms"] for c in cells if c["batch_size"] == c["new_tokens"] == 1), cells[0]["cpu_ms"])
    for c in cells:
        c["ratio"] = round(c["cpu_ms"] / base, 2)
        c["tokens_per_cpu_s"] = round(c["batch_size"] * c["new_tokens"] / c["cpu_ms"] * 1000, 1)
    parameters = sum(p.numel() for p in model.net.parameters())
    return {"model": model.name, "parameters": parameters, "dtype": str(model.dtype).removeprefix("torch."),
            "context": context, "repeats": repeats, "machine": machine(), "cells": cells}


def table(result: dict) -> str:
    """Milliseconds per forward (and the ratio to B = 1, T = 1): batch sizes down, new tokens across."""
    tokens = sorted({c["new_tokens"] for c in result["cells"]})
    batches = sorted({c["batch_size"] for c in result["cells"]})
    cell = {(c["batch_size"], c["new_tokens"]): c for c in result["cells"]}
    lines = [f"{result['model']} ({result['parameters']:,} parameters, {result['dtype']}), KV cache of "
             f"{result['context']} positions, {result['machine']['threads']} thread(s): CPU ms per forward "
             "(x the B=1, T=1 forward)", "",
             "| batch \\ new tokens | " + " | ".join(map(str, tokens)) + " |",
             "|---|" + "---|" * len(tokens)]
    for b in batches:
        row = [f"{cell[b, t]['cpu_ms']:.2f} ({cell[b, t]['ratio']:.1f}x)" for t in tokens]
        lines.append(f"| {b} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """A heat map of log2(time / time at B = 1, T = 1) over batch size x new tokens."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = sorted({c["new_tokens"] for c in result["cells"]})
    batches = sorted({c["batch_size"] for c in result["cells"]})
    ratio = {(c["batch_size"], c["new_tokens"]): c["ratio"] for c in result["cells"]}
    grid = [[math.log2(max(ratio[b, t], 1e-3)) for t in tokens] for b in batches]
    fig, ax = plt.subplots(figsize=(1.2 * len(tokens) + 2.5, 0.55 * len(batches) + 1.8))
    image = ax.imshow(grid, origin="lower", cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(tokens)), [str(t) for t in tokens])
    ax.set_yticks(range(len(batches)), [str(b) for b in batches])
    ax.set_xlabel("new tokens per row (T)")
    ax.set_ylabel("batch size (B)")
    for i, b in enumerate(batches):
        for j, t in enumerate(tokens):
            ax.text(j, i, f"{ratio[b, t]:.1f}", ha="center", va="center", fontsize=8,
                    color="white" if grid[i][j] < max(map(max, grid)) / 2 else "black")
    fig.colorbar(image, ax=ax, label="log2(forward CPU time / time at B=1, T=1)")
    ax.set_title(f"{result['model']}: forward time on a {result['context']}-position KV cache\n"
                 "(cells: x the B=1, T=1 forward)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
