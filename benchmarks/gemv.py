"""One layer's GEMV streamed from memory: decodekit's kernels (models/kernels.py) against
PyTorch's ops, in the same run (issue 23).

896 -> 4864 (Qwen2.5-0.5B's gate or up projection), 40 different weight matrices per format
so nothing stays in the L3; each round times one pass over the 40 per op, the rounds
interleaved over the ops; the median round's microseconds per matrix and the weight bytes
read per second are printed. Usage: python benchmarks/gemv.py [--threads 1] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from decodekit.models import kernels
from decodekit.models.qlinear import QuantizedLinear, torch_kernel
from decodekit.models.quant_grid import QuantSpec

K, N, COPIES = 896, 4864, 40


def cases(rows: int) -> dict[str, tuple[list, callable, int]]:
    """name -> (per-matrix operands, fn(operands) , bytes per matrix)."""
    torch.manual_seed(0)
    x = torch.randn(rows, K)
    xb = x.bfloat16()
    f32 = [torch.randn(N, K) / K**0.5 for _ in range(COPIES)]
    f32t = [w.t().contiguous().t() for w in f32]
    bf16 = [w.bfloat16() for w in f32]
    bf16t = [w.t().contiguous().t() for w in bf16]
    out = {
        "f32 torch x @ W_t": (f32t, lambda w: x @ w.t(), N * K * 4),
        "f32 kernel (transposed)": (f32t, lambda w: kernels.float_linear(x, w, None), N * K * 4),
        "f32 kernel (row-major)": (f32, lambda w: kernels.float_linear(x, w, None), N * K * 4),
        "bf16 torch F.linear": (bf16, lambda w: F.linear(xb, w), N * K * 2),
        "bf16 torch mv": (bf16, lambda w: torch.mv(w, xb[0]) if rows == 1 else F.linear(xb, w), N * K * 2),
        "bf16 kernel (row-major)": (bf16, lambda w: kernels.float_linear(xb, w, None), N * K * 2),
        "bf16 kernel (transposed)": (bf16t, lambda w: kernels.float_linear(xb, w, None), N * K * 2),
    }
    linear = torch.nn.Linear(K, N, bias=False)
    for bits, group in ((8, None), (8, 32), (8, 64), (8, 128), (4, None), (4, 32), (4, 128)):
        layers = []
        for w in f32[:COPIES]:
            linear.weight.data = w
            layer = QuantizedLinear.from_linear(linear, QuantSpec(bits, group))
            layer.set_kernel(torch_kernel(layer.spec, K, N))
            layers.append(layer)
        name = f"int{bits} {'channel' if group is None else f'g{group}'}"
        size = N * K * bits // 8 + N * (K // (group or K)) * 4
        fallback = [(l, l.kernel) for l in layers]
        out[f"{name} today ({layers[0].kernel})"] = (fallback, lambda lk: _run(lk, x), size)
        if kernels.available():
            native = []
            for layer in layers:
                copy = QuantizedLinear.from_linear(
                    linear, QuantSpec(bits, group), layer.codes(), layer.scales
                )
                copy.set_kernel("auto")
                native.append((copy, copy.kernel))
            out[f"{name} kernel ({native[0][1]})"] = (native, lambda lk: _run(lk, x), size)
    return out


def _run(layer_kernel, x):
    return layer_kernel[0](x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--only", default="", help="run the ops whose name contains this")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"kernels: {kernels.status().reason}; threads {args.threads}; rows {args.rows}")
    table = {name: case for name, case in cases(args.rows).items() if args.only in name}
    times: dict[str, list[float]] = {name: [] for name in table}
    with torch.inference_mode():
        for round_ in range(args.rounds + 1):
            for name, (operands, fn, _) in table.items():
                start = time.perf_counter()
                for operand in operands:
                    fn(operand)
                if round_:
                    times[name].append((time.perf_counter() - start) / len(operands))
    for name, (_, _, size) in table.items():
        t = statistics.median(times[name])
        print(f"{name:32s} {t * 1e6:8.0f} us  {size / t / 1e9:6.1f} GB/s")


if __name__ == "__main__":
    main()
