"""One quantised layer's prefill (64-512 rows) on each path against the float32 GEMM of the same
shape, the ops interleaved, one thread, process CPU time (issue 39).

    python benchmarks/prefill_ops.py [--shapes 896x4864,4864x896,896x896] [--rows 64,128,256,512]
                                     [--rounds 7] [--formats w4a8,w8a8,w8a8-g32,int4,int8]

Per shape K x N and row count, each round calls every op once (the first round warms up); the
median round's microseconds per call and the speed against PyTorch's float32 `F.linear` (MKL /
oneDNN sgemm) are printed as one JSON document. Ops:

- "F.linear": float32 x Wᵀ with W row-major, the GEMM a quantised layer's prefill runs over its
  dequantised weight (qlinear.py `QuantizedLinear.packed_matmul`; the W8A8 / W4A8 layers' path
  before issue 39's kernels);
- "gemm": decodekit's float32 GEMM over the transposed layout (`kernels.float_linear`), what a
  float32 model's prefill runs;
- per format, the layer itself (`QuantizedLinear`, so exactly the path a model's prefill takes:
  "w4a8" / "w8a8" the integer kernels of csrc/gemv_a8.cpp, "int4" / "int8" weight-only), and
  "FORMAT dequant": the previous prefill path, the weight dequantised per call and one GEMM;
  "FORMAT dequant only" times the dequantisation alone (its share of that path).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from decodekit.models import kernels
from decodekit.models.qlinear import QuantizedLinear, prefill_dtype
from decodekit.models.quant_grid import QuantSpec, dequantize, quantize_activations

FORMATS = {  # name -> QuantSpec
    "w4a8": QuantSpec(4, None, activation_bits=8),
    "w8a8": QuantSpec(8, None, activation_bits=8),
    "w8a8-g32": QuantSpec(8, 32, activation_bits=8),
    "int4": QuantSpec(4, None),
    "int8": QuantSpec(8, None),
}


def ops(k: int, n: int, formats: list[str]) -> dict:
    """name -> fn(x) for a layer of k inputs and n outputs."""
    torch.manual_seed(k * n)
    linear = nn.Linear(k, n, bias=False)
    w = linear.weight.detach()
    wt = w.t().contiguous().t()  # the transposed float32 layout
    out = {"F.linear": lambda x: F.linear(x, w)}
    dtype = prefill_dtype()
    if kernels.available():
        out["gemm"] = lambda x: kernels.float_linear(x, wt, None)
    for name in formats:
        spec = FORMATS[name]
        layer = QuantizedLinear.from_linear(linear, spec)

        def dequant(x, layer=layer, a8=spec.activation_bits is not None):
            x = quantize_activations(x) if a8 else x
            return F.linear(x.to(dtype), dequantize(layer.codes(), layer.scales, dtype)).to(x.dtype)

        out[name] = layer
        out[f"{name} dequant"] = dequant
        out[f"{name} dequant only"] = lambda x, layer=layer: dequantize(layer.codes(), layer.scales, dtype)
    return out


def measure(k: int, n: int, rows: int, rounds: int, formats: list[str]) -> dict:
    table = ops(k, n, formats)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    times: dict[str, list[float]] = {name: [] for name in table}
    with torch.inference_mode():
        for round_ in range(rounds + 1):
            for name, fn in table.items():
                start = time.process_time()
                fn(x)
                if round_:  # the first round warms up
                    times[name].append(time.process_time() - start)
    us = {name: 1e6 * statistics.median(t) for name, t in times.items()}
    base = us["F.linear"]
    return {name: {"us": round(t, 1), "vs_F.linear": round(base / t, 2)} for name, t in us.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="896x4864,4864x896,896x896")
    parser.add_argument("--rows", default="64,128,256,512")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--formats", default="w4a8,w8a8,w8a8-g32,int4,int8")
    args = parser.parse_args()
    torch.set_num_threads(1)
    formats = args.formats.split(",")
    result: dict = {"kernels": kernels.status().reason, "threads": 1, "clock": "process CPU time",
                    "torch": torch.__version__, "shapes": {}}  # fmt: skip
    for shape in args.shapes.split(","):
        k, n = map(int, shape.split("x"))
        result["shapes"][f"{k}->{n}"] = {
            rows: measure(k, n, rows, args.rounds, formats) for rows in map(int, args.rows.split(","))
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
