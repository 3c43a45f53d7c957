"""The ATen calls one graphed decode step dispatches (issue 33): a CUDA graph replays its
kernels back to back, a few microseconds each however small, so at batch 1 a small model's
replay costs about its kernel count, not its arithmetic.

    python benchmarks/graph_step_ops.py [--shape qwen2.5-0.5b] [--rows 1,64] [--dtype bfloat16]

Counts, on the CPU, the ATen calls that are not views (about one kernel each on a GPU) of one
`GraphedLanes` step (engine/cuda_graphs.py) with its two attention forms: the
written-out one (`fused_attention=False`, a dozen calls a layer over the rows and the new
key beside them) and the writing one (the new key written into its row, one SDPA call).
Random weights of the named shape, its first two layers and its whole depth; prints one
JSON line per (form, rows) with the calls per step, per layer (the two depths' difference)
and the most frequent calls.
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from decodekit.bench.decode import machine
from decodekit.engine.compiled import lanes_step
from decodekit.models import shapes


class CountCalls(TorchDispatchMode):
    """Counts the ATen calls below it that are not views (a view launches no kernel)."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # `to` is declared an alias of its input (it is one when nothing changes): a cast counts
        copied = isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor) \
            and out.untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr()
        if not func.is_view or copied:
            self.calls[func.overloadpacket.__name__] += 1
        return out


def step_calls(model, rows: int, writes: bool, capacity: int = 256) -> collections.Counter:
    """The calls of one step of `rows` rows, each holding 100 positions of `capacity`."""
    config = model.config
    step = lanes_step(model, "counted_step", writes=writes)
    shape = (config.num_layers, rows, config.num_kv_heads, capacity, config.head_dim)
    keys = torch.randn(shape, dtype=model.dtype)
    values = torch.randn(shape, dtype=model.dtype)
    tokens = torch.arange(rows)[:, None] + 5
    positions = stored = torch.full((rows,), 100)
    # in inference mode, as the engine runs it: the mode sees a composite call (linear,
    # matmul, rms_norm, SDPA) once, before the CPU decomposes it, as CUDA runs one kernel
    # for each (rms_norm: torch's fused kernel)
    with torch.inference_mode():
        step(tokens, positions, stored, keys, values)  # first-call work (lazy tables) not counted
        with CountCalls() as counter:
            step(tokens, positions, stored, keys, values)
    return counter.calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(shapes.SHAPES))
    parser.add_argument("--rows", default="1,64", help="comma-separated row counts")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(1)
    depth = shapes.shape_config(args.shape, args.dtype)["num_hidden_layers"]
    models = {layers: shapes.random_model(args.shape, args.dtype, layers=layers) for layers in (2, depth)}
    for writes in (False, True):
        for rows in [int(r) for r in args.rows.split(",")]:
            two, whole = (step_calls(models[layers], rows, writes) for layers in (2, depth))
            per_layer = (sum(whole.values()) - sum(two.values())) / (depth - 2)
            print(json.dumps({"shape": args.shape, "dtype": args.dtype, "layers": depth, "rows": rows,
                              "attention": "sdpa, writing" if writes else "written out",
                              "calls_per_step": sum(whole.values()), "calls_per_layer": per_layer,
                              "top_calls": dict(whole.most_common(8)), "machine": machine()}))


if __name__ == "__main__":
    main()
