"""Float32 linear layers at 1-64 rows: decodekit's small-M GEMM (`decodekit::linear_gemm`,
csrc/gemm.cpp), its axpy GEMV (`decodekit::linear_t`) and PyTorch's `F.linear` (MKL / oneDNN
sgemm) over the transposed weight layout models/native.py keeps, in the same run (issue 25).

The linear layers of one model's decode step in model order, each layer its own weights
(`shakespeare`: 4 layers; the 240M shape `qwen2.5-0.5b-16l`: --layers of its 16, and its
tied lm head), so the weights stream from memory or L3 as in a step. Each round calls every
op on every layer, the ops interleaved; the median round's process CPU time per shape is
printed as JSON with GFLOP/s. Usage: python benchmarks/gemm_rows.py [--rows 1,4,8,16,32,64]
[--model shakespeare|240m|8b] [--rounds 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from decodekit.models import kernels

# (K, N) of each linear layer in one decoder layer, and the lm head's.
MODELS = {
    "shakespeare": {
        "layers": 4,
        "shapes": [(256, 512), (256, 256), (256, 1376), (688, 256)],
        "head": (256, 2048),
    },
    "240m": {
        "layers": 16,
        "shapes": [(896, 1152), (896, 896), (896, 9728), (4864, 896)],
        "head": (896, 151936),
    },
    # Llama-3.1-8B's layers (fused q/k/v and gate/up, as NativeLM holds them), the shapes'
    # cut 2,048-token head: every weight row stride a multiple of 4 KiB
    "8b": {
        "layers": 1,
        "shapes": [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)],
        "head": (4096, 2048),
    },
}


def ops() -> dict:
    out = {"torch": lambda x, w: F.linear(x, w)}
    if kernels.available():
        out["axpy"] = lambda x, w: torch.ops.decodekit.linear_t(x, w.t(), None)
        out["gemm"] = lambda x, w: torch.ops.decodekit.linear_gemm(x, w, None)
    return out


def measure(model: str, rows: int, rounds: int, layers: int | None) -> dict:
    spec = MODELS[model]
    count = layers or spec["layers"]
    g = torch.Generator().manual_seed(0)
    weights = []  # (shape, weight [N, K] stored transposed)
    for _ in range(count):
        for k, n in spec["shapes"]:
            weights.append(((k, n), (torch.randn(k, n, generator=g) / k**0.5).t()))
    k, n = spec["head"]
    weights.append(((k, n), (torch.randn(k, n, generator=g) / k**0.5).t()))
    xs = {k: torch.randn(rows, k, generator=g) for k in {shape[0] for shape, _ in weights}}
    table = ops()
    times = {(op, shape): [] for op in table for shape, _ in weights}
    with torch.inference_mode():
        for round_ in range(rounds + 1):
            spent = {key: 0.0 for key in times}
            for op, fn in table.items():
                for shape, w in weights:
                    start = time.process_time()
                    fn(xs[shape[0]], w)
                    spent[op, shape] += time.process_time() - start
            if round_:  # the first round warms up
                for key, t in spent.items():
                    times[key].append(t)
    result = {}
    for (op, shape), ts in times.items():
        calls = sum(1 for s, _ in weights if s == shape)
        t = statistics.median(ts) / calls
        flops = 2 * rows * shape[0] * shape[1]
        result.setdefault(f"{shape[0]}->{shape[1]}", {})[op] = {
            "us": round(t * 1e6, 1),
            "gflops": round(flops / t / 1e9, 1),
        }
    return result


def check(rows: int) -> None:
    """The kernels give the bits of linear_t (the same sum order) and F.linear's values."""
    x, wt = torch.randn(rows, 200), torch.randn(200, 75)
    y = torch.ops.decodekit.linear_gemm(x, wt.t(), None)
    assert torch.equal(y, torch.ops.decodekit.linear_t(x, wt, None))
    torch.testing.assert_close(y, x @ wt, atol=1e-4, rtol=1e-4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="shakespeare", choices=sorted(MODELS))
    parser.add_argument("--rows", default="1,4,8,16,32,64")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--layers", type=int, default=None, help="decoder layers timed (default: the model's)"
    )
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = {"model": args.model, "kernels": kernels.status().reason, "threads": args.threads, "rows": {}}
    for rows in map(int, args.rows.split(",")):
        if kernels.available():
            check(rows)
        out["rows"][rows] = measure(args.model, rows, args.rounds, args.layers)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
