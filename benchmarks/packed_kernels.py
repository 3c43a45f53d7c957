"""The matmuls of one decode token of a shape (models/shapes.py), one layer at a time: what
bounds a quantised model's decode speed below llama.cpp's (issue 15, item 7; BENCHMARKS.md
"Against llama.cpp").

    python benchmarks/packed_kernels.py [--shape qwen2.5-0.5b-16l] [--calls 30]

For each of a layer's four projections (q/k/v fused, o, gate/up fused, down: NativeLM's
layout) at M = 1 (one token): the float32 matmul (`F.linear`) and the int8 and int4
`QuantizedLinear` layers (per-channel RTN; the kernels and casts the compressed models run,
models/qlinear.py), median CPU time of `calls` calls after a warm-up, the variants
interleaved, one thread. Then the sum per token (times the layer count), and the weight
bytes each reads per token. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from decodekit.models.qlinear import QuantizedLinear
from decodekit.models.quant_grid import QuantSpec
from decodekit.models.shapes import shape_config


def projections(config: dict) -> dict[str, tuple[int, int]]:
    """name -> (in_features, out_features) of one decoder layer's matmuls."""
    hidden, width = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    attention, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"qkv": (hidden, attention + 2 * kv), "o": (attention, hidden), "gate_up": (hidden, 2 * width),
            "down": (width, hidden)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b-16l")
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = shape_config(args.shape)
    layers = config["num_hidden_layers"]
    result: dict = {"shape": args.shape, "layers": layers, "threads": 1, "clock": "process CPU time",
                    "torch": torch.__version__, "microseconds": {}}  # fmt: skip
    per_token = {"float32": 0.0, "int8pack": 0.0, "int4pack": 0.0}
    weight_bytes = {"float32": 0, "int8pack": 0, "int4pack": 0}
    with torch.inference_mode():
        for name, (k, n) in projections(config).items():
            linear = nn.Linear(k, n, bias=False)
            nn.init.normal_(linear.weight, std=k**-0.5)
            int8 = QuantizedLinear.from_linear(linear, QuantSpec(8))
            int4 = QuantizedLinear.from_linear(linear, QuantSpec(4))
            assert (int8.kernel, int4.kernel) == ("int8pack", "int4pack"), (int8.kernel, int4.kernel)
            x = torch.randn(1, 1, k)  # [B, T, K]: one decode token
            weight = linear.weight
            fns = {"float32": lambda x=x, w=weight: F.linear(x, w), "int8pack": lambda x=x, m=int8: m(x),
                   "int4pack": lambda x=x, m=int4: m(x)}  # fmt: skip
            times: dict[str, list[float]] = {kind: [] for kind in fns}
            for fn in fns.values():
                fn()
            for _ in range(args.calls):
                for kind, fn in fns.items():
                    start = time.process_time()
                    fn()
                    times[kind].append(time.process_time() - start)
            row = {kind: round(1e6 * statistics.median(t), 1) for kind, t in times.items()}
            result["microseconds"][f"{name} {k}x{n}"] = row
            for kind in per_token:
                per_token[kind] += layers * row[kind] / 1000
            weight_bytes["float32"] += layers * 4 * k * n
            weight_bytes["int8pack"] += layers * k * n
            weight_bytes["int4pack"] += layers * k * n // 2
    result["matmul_ms_per_token"] = {kind: round(ms, 2) for kind, ms in per_token.items()}
    result["weight_mib_per_token"] = {kind: round(b / 2**20, 1) for kind, b in weight_bytes.items()}
    result["gb_per_s"] = {kind: round(weight_bytes[kind] / per_token[kind] / 1e6, 1) for kind in per_token}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
