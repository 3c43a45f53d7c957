"""One decode token's matmuls of a shape on decodekit's kernel ops themselves (issue 39): where
the time of a quantised layer goes, op by op, against the float32 kernel.

    python benchmarks/kernel_ops.py [--shape qwen2.5-0.5b-16l] [--rows 1] [--calls 40]

For each of a layer's projections (NativeLM's fused q/k/v, o, fused gate/up, down) and `rows`
rows of x: the float32 kernel over the transposed layout (`kernels.float_linear`, what a
float32 model runs), int8 weight-only per channel and in groups of 64 (`linear_rows`), int4
weight-only per channel and in groups of 64 (`linear_int4`), and the opt-in W8A8 / W4A8 ops
(per channel), median CPU time of `calls` calls, the ops interleaved, one thread. Per op: the
microseconds per token (the layer count times the sum over projections), the weight bytes
read per second, and the speed against float32. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from decodekit.models import kernels
from decodekit.models.shapes import shape_config

sys.path.insert(0, str(Path(__file__).parent))
from packed_kernels import projections  # noqa: E402


def operands(k: int, n: int) -> dict:
    """name -> (call, weight bytes) for a layer of k inputs and n outputs."""
    g = torch.Generator().manual_seed(k * n)
    w = torch.randn(n, k, generator=g) / k**0.5
    ops = torch.ops.decodekit
    wt = w.t().contiguous().t()  # the transposed float32 layout
    per_row = w.abs().amax(1, keepdim=True)
    codes8 = torch.round(w / per_row * 127).to(torch.int8)
    s8 = (per_row / 127).float()
    g64 = w.view(n, k // 64, 64).abs().amax(-1)
    codes8g = torch.round(w.view(n, k // 64, 64) / g64[..., None] * 127).to(torch.int8).view(n, k)
    codes4 = torch.round(w / per_row * 7).to(torch.int8)
    codes4g = torch.round(w.view(n, k // 64, 64) / g64[..., None] * 7).to(torch.int8).view(n, k)
    width = -(-k // 128) * 128
    p4, p4g = kernels.pack_int4_blocks(codes4, width), kernels.pack_int4_blocks(codes4g, width)
    s4 = (per_row / 7).float()
    s4g = torch.nn.functional.pad(g64 / 7, (0, width // 64 - k // 64)).float()
    a8, a4 = kernels.pack_a8_blocks(codes8, 8), kernels.pack_a8_blocks(codes4, 4)
    return {
        "float32": (lambda x: kernels.float_linear(x, wt, None), 4 * n * k),
        "int8": (lambda x: ops.linear_rows(x, codes8, s8, k, None), n * k),
        "int8 g64": (lambda x: ops.linear_rows(x, codes8g, (g64 / 127).float(), 64, None), n * k),
        "int4": (lambda x: ops.linear_int4(x, p4, s4, width, None), n * k // 2),
        "int4 g64": (lambda x: ops.linear_int4(x, p4g, s4g, 64, None), n * k // 2),
        "w8a8": (lambda x: ops.linear_w8a8(x, a8, s8, None), n * k),
        "w4a8": (lambda x: ops.linear_w4a8(x, a4, s4, None), n * k // 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b-16l")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    assert kernels.available(), kernels.status().reason
    config = shape_config(args.shape)
    layers = config["num_hidden_layers"]
    per_token: dict[str, float] = {}
    bytes_per_token: dict[str, int] = {}
    layer_us: dict[str, dict] = {}
    with torch.inference_mode():
        for name, (k, n) in projections(config).items():
            x = torch.randn(args.rows, k)
            calls = operands(k, n)
            times: dict[str, list[float]] = {op: [] for op in calls}
            for fn, _ in calls.values():
                fn(x)
            for _ in range(args.calls):
                for op, (fn, _) in calls.items():
                    start = time.process_time()
                    fn(x)
                    times[op].append(time.process_time() - start)
            row = {op: round(1e6 * statistics.median(t), 1) for op, t in times.items()}
            layer_us[f"{name} {k}x{n}"] = row
            for op, (_, size) in calls.items():
                per_token[op] = per_token.get(op, 0.0) + layers * row[op]
                bytes_per_token[op] = bytes_per_token.get(op, 0) + layers * size
    base = per_token["float32"]
    summary = {
        op: {"ms_per_token": round(us / 1000, 2), "weight_gb_s": round(bytes_per_token[op] / us / 1000, 2),
             "vs_float32": round(base / us, 2)}
        for op, us in per_token.items()
    }  # fmt: skip
    head = {"shape": args.shape, "rows": args.rows, "isa": kernels.status().reason, "threads": 1}
    result = {**head, "clock": "process CPU time", "microseconds": layer_us, "per_token": summary}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
