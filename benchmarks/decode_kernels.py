"""End-to-end batch-1 decode (and 400-token prefill) with decodekit's native GEMV kernels on
and off, interleaved in one process (issue 23; models/kernels.py).

Models: the 240M random model of Qwen2.5-0.5B's layer shapes (`qwen2.5-0.5b-16l`) or an
embedded one, in float32, bfloat16, and RTN int8 / int4 copies (per channel and grouped).
"off" is what runs where the kernels are not built: PyTorch's ops (float models with
DECODEKIT_KERNELS=0; quantised ones on `torch_kernel`'s path). CPU seconds of this process
(`time.process_time`; `--clock wall` for wall-clock seconds, the measure for two threads),
median of the rounds, the rounds interleaved over every row.
Usage: python benchmarks/decode_kernels.py [--model qwen2.5-0.5b-16l] [--threads 1] [--clock wall]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import decodekit as dk
from decodekit.bench.packed import PROMPT, load
from decodekit.compress.evaluate import TEST_TEXT
from decodekit.compress.recipe import CompressConfig, quantized_copy
from decodekit.models import kernels
from decodekit.models.qlinear import QuantizedLinear, kernel_counts, torch_kernel

QUANT = {
    "int8": (8, None),
    "int8 g64": (8, 64),
    "int8 g128": (8, 128),
    "int4": (4, None),
    "int4 g32": (4, 32),
}


def set_native(on: bool) -> None:
    os.environ[kernels.DISABLE_ENV] = "1" if on else "0"
    kernels.status.cache_clear()


def torch_path(model) -> None:
    for module in model.net.modules():
        if isinstance(module, QuantizedLinear):
            module.set_kernel(torch_kernel(module.spec, module.in_features, module.out_features))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-0.5b-16l")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prefill-tokens", type=int, default=400)
    parser.add_argument("--rows", default=",".join(["float32", "bfloat16", *QUANT]))
    parser.add_argument("--no-prefill", action="store_true")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    state = kernels.status().reason
    print(f"kernels: {state}; threads {args.threads}; model {args.model}; {args.clock} clock")
    params = dk.SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    base = load(args.model, torch.float32)
    prefill = torch.tensor([base.encode(TEST_TEXT.read_text())[: args.prefill_tokens]])
    rows = args.rows.split(",")
    models: dict[str, tuple] = {}  # name -> (on model, off model, float?)
    for name in rows:
        if name in ("float32", "bfloat16"):
            model = base if name == "float32" else load(args.model, torch.bfloat16)
            models[name] = (model, model, True)
        else:
            bits, group = QUANT[name]
            config = CompressConfig("rtn", bits=bits, group_size=group)
            on, off = quantized_copy(base, config), quantized_copy(base, config)
            set_native(False)
            torch_path(off)
            set_native(True)
            print(name, "on:", kernel_counts(on.net), "off:", kernel_counts(off.net))
            models[name] = (on, off, False)
    fns = {}
    for name, (on, off, _) in models.items():
        for flag, model in (("on", on), ("off", off)):
            fns[("decode", name, flag)] = lambda m=model: dk.generate(m, PROMPT, params)
            if not args.no_prefill:
                fns[("prefill", name, flag)] = lambda m=model: m.forward(prefill, m.new_cache(1))
    times: dict = {key: [] for key in fns}
    with torch.inference_mode():
        for round_ in range(args.repeats + 1):
            for key, fn in fns.items():
                set_native(key[2] == "on")
                start = clock()
                fn()
                if round_:
                    times[key].append(clock() - start)
    set_native(True)
    result = {}
    for name in models:
        row = {}
        for kind, count in (("decode", args.new_tokens), ("prefill", prefill.shape[1])):
            if (kind, name, "on") in times:
                on = count / statistics.median(times[(kind, name, "on")])
                off = count / statistics.median(times[(kind, name, "off")])
                row[kind] = {"on": round(on, 1), "off": round(off, 1), "ratio": round(on / off, 2)}
        result[name] = row
        print(
            f"{name:10s} "
            + "  ".join(
                f"{k} on {v['on']:7.1f} off {v['off']:7.1f} tok/s ({v['ratio']:.2f}x)" for k, v in row.items()
            )
        )
    print(json.dumps({"threads": args.threads, "clock": args.clock, "model": args.model, "rows": result}))


if __name__ == "__main__":
    main()
