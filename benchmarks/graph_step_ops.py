"""The ATen calls one graphed decode step dispatches (issue 33): a CUDA graph replays its
kernels back to back, a few microseconds each however small, so at batch 1 a small model's
replay costs about its kernel count, not its arithmetic.

    python benchmarks/graph_step_ops.py [--shape qwen2.5-0.5b] [--rows 1,64] [--dtype bfloat16] [--prefix 512]

Counts, on the CPU, the ATen calls that are not views (about one kernel each on a GPU) of one
`GraphedLanes` step (engine/cuda_graphs.py) with its two attention forms: the
written-out one (`fused_attention=False`, a dozen calls a layer over the rows and the new
key beside them), the writing one (the new key written into its row, one SDPA call) and the
writing one of rows that continue a shared prefix (the prefixed graph: the prefix and the row
under one softmax, written out).
Random weights of the named shape, its first two layers and its whole depth; prints one
JSON line per (form, rows) with the calls per step, per layer (the two depths' difference)
and the most frequent calls.
"""

from __future__ import annotations

import argparse
import collections
import json

import torch

from decodekit.bench.aten_calls import CountCalls
from decodekit.bench.decode import machine
from decodekit.engine.compiled import lanes_step
from decodekit.models import shapes


def step_calls(model, rows: int, writes: bool, prefix: int = 0, capacity: int = 256) -> collections.Counter:
    """The calls of one step of `rows` rows, each holding 100 positions of `capacity`, and
    continuing a shared prefix of `prefix` positions when it is not 0 (the prefixed graph)."""
    config = model.config
    step = lanes_step(model, "counted_step", prefixed=prefix > 0, writes=writes)
    shape = (config.num_layers, rows, config.num_kv_heads, capacity, config.head_dim)
    keys = torch.randn(shape, dtype=model.dtype)
    values = torch.randn(shape, dtype=model.dtype)
    tokens = torch.arange(rows)[:, None] + 5
    positions = stored = torch.full((rows,), 100)
    args = (tokens, positions, stored, keys, values)
    if prefix:
        shared = (config.num_layers, 1, config.num_kv_heads, prefix, config.head_dim)
        bounds = torch.tensor([[0] * rows, [prefix] * rows])
        args += (torch.randn(shared, dtype=model.dtype), torch.randn(shared, dtype=model.dtype), bounds)
    # in inference mode, as the engine runs it: the mode sees a composite call (linear,
    # matmul, rms_norm, SDPA) once, before the CPU decomposes it, as CUDA runs one kernel
    # for each (rms_norm: torch's fused kernel)
    with torch.inference_mode():
        step(*args)  # first-call work (lazy tables) not counted
        with CountCalls() as counter:
            step(*args)
    return counter.calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(shapes.SHAPES))
    parser.add_argument("--rows", default="1,64", help="comma-separated row counts")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prefix", type=int, default=512, help="positions of the prefixed graph's prefix")
    args = parser.parse_args()
    torch.set_num_threads(1)
    depth = shapes.shape_config(args.shape, args.dtype)["num_hidden_layers"]
    models = {layers: shapes.random_model(args.shape, args.dtype, layers=layers) for layers in (2, depth)}
    forms = {"written out": (False, 0), "sdpa, writing": (True, 0),
             f"writing, a shared prefix of {args.prefix}": (True, args.prefix)}  # fmt: skip
    for form, (writes, prefix) in forms.items():
        for rows in [int(r) for r in args.rows.split(",")]:
            two, whole = (step_calls(models[layers], rows, writes, prefix) for layers in (2, depth))
            per_layer = (sum(whole.values()) - sum(two.values())) / (depth - 2)
            print(json.dumps({"shape": args.shape, "dtype": args.dtype, "layers": depth, "rows": rows,
                              "attention": form,
                              "calls_per_step": sum(whole.values()), "calls_per_layer": per_layer,
                              "top_calls": dict(whole.most_common(8)), "machine": machine()}))


if __name__ == "__main__":
    main()
