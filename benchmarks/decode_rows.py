"""Batch-1 greedy decode of RTN-quantised copies of a model against the float32 model, the
rounds interleaved in one process, one thread, process CPU time (issue 39): how a kernel change
moves each format's speed relative to float32, whose path it does not touch.

    python benchmarks/decode_rows.py [--model qwen2.5-0.5b-16l] [--rows int4,int4-g64,int8]

Rows: NAME = int4 / int8 with "-gG" for groups of G inputs (per channel without) and "-a8"
for the activation-quantised kernels (W4A8 / W8A8). Per row: 32 new tokens after
bench/packed.py's prompt (EOS ignored), median of `repeats` rounds after a warm-up
(bench/packed.py's `median_seconds`), tokens/s and the ratio to float32. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json

import torch

from decodekit.bench.packed import decode_timers, load, median_seconds
from decodekit.compress.recipe import CompressConfig, quantized_copy
from decodekit.models import kernels
from decodekit.models.qlinear import kernel_counts


def config(row: str) -> CompressConfig:
    """Row "int4-g64-a8" -> RTN, 4 bits, groups of 64, activation_bits 8."""
    bits, *rest = row.split("-")
    group = next((int(part[1:]) for part in rest if part.startswith("g")), None)
    return CompressConfig("rtn", bits=int(bits.removeprefix("int")), group_size=group,
                          activation_bits=8 if "a8" in rest else None)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-0.5b-16l")
    parser.add_argument("--rows", default="int4,int4-g64,int8,int8-g64,int8-a8,int8-g32-a8,int4-a8")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = load(args.model, torch.float32)
    models = {"float32": base}
    counts = {}
    for row in args.rows.split(","):
        models[row] = quantized_copy(base, config(row))
        counts[row] = kernel_counts(models[row].net)
    prompt = torch.tensor([base.encode("ROMEO:")])
    timers = {name: timer for name, timer in decode_timers(models, args.new_tokens, prompt).items()
              if name.startswith("decode ")}  # fmt: skip
    seconds = median_seconds(timers, args.repeats)
    speed = {name: args.new_tokens / seconds[f"decode {name}"][0] for name in models}
    rows = {name: {"decode_tok_s": round(tok_s, 2), "vs_float32": round(tok_s / speed["float32"], 2),
                   **({"kernels": counts[name]} if name in counts else {})}
            for name, tok_s in speed.items()}  # fmt: skip
    head = {"model": args.model, "kernels": kernels.status().reason, "threads": 1, "clock": "process CPU"}
    print(json.dumps({**head, "new_tokens": args.new_tokens, "repeats": args.repeats, "rows": rows}))


if __name__ == "__main__":
    main()
