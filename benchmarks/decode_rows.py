"""Batch-1 greedy decode of RTN-quantised copies of a model against the float32 model, the
rounds interleaved in one process, one thread, process CPU time (issue 39): how a kernel change
moves each format's speed relative to float32, whose path it does not touch.

    python benchmarks/decode_rows.py [--model qwen2.5-0.5b-16l] [--rows int4,int4-g64,int8]
                                     [--compile] [--peer llamacpp] [--threads 1]

Rows: NAME = int4 / int8 with "-gG" for groups of G inputs (per channel without), "-a8"
for the activation-quantised kernels (W4A8 / W8A8) and "-hB" for the output head on a B-bit
grid (llama.cpp's files quantise theirs; at the shapes' cut 2,048-token vocabulary
`compress` keeps it float, CompressConfig's "auto"). Per row: 32 new tokens after
bench/packed.py's prompt (EOS ignored), median of `repeats` rounds after a warm-up
(bench/packed.py's `median_seconds`), tokens/s and the ratio to float32. Prints one JSON line.
`--compile`: every row (float32 too) decodes through the engine's compiled decode step, as
`decodekit bench packed --compile` and a long-running engine do; without it the eager step's
Python (~20 ms a token at this shape on a Zen 3) is in every row.
`--peer llamacpp`: llama.cpp's f32, q8_0 and q4_0 files of the same weights (bench/llamacpp.py,
built by scripts/peers.sh) in the same rounds, decode and a prefill of `--prefill-tokens`
tokens for every row, and the ratios of the pairs the issue names (`PAIRS`): the subset of
`decodekit bench packed --peer llamacpp` that a loaded 2-core machine can run in minutes.
With more than one thread the clock is the wall clock (CPU time adds up the threads).
"""

from __future__ import annotations

import argparse
import json
from contextlib import ExitStack

import torch

from decodekit.bench import llamacpp
from decodekit.bench.packed import PROMPT, decode_timers, load, median_seconds
from decodekit.compress.evaluate import TEST_TEXT
from decodekit.compress.recipe import CompressConfig, quantized_copy
from decodekit.models import kernels
from decodekit.models.qlinear import kernel_counts

PAIRS = (("float32", "f32"), ("int8", "q8_0"), ("int8-g32-a8", "q8_0"), ("int8-a8", "q8_0"),
         ("int4", "q4_0"), ("int4-a8", "q4_0"))  # fmt: skip


def config(row: str) -> CompressConfig:
    """Row "int4-g64-a8-h8" -> RTN, 4 bits, groups of 64, activation_bits 8, an int8 head."""
    bits, *rest = row.split("-")
    group = next((int(part[1:]) for part in rest if part.startswith("g")), None)
    head = next((int(part[1:]) for part in rest if part.startswith("h")), "auto")
    return CompressConfig("rtn", bits=int(bits.removeprefix("int")), group_size=group,
                          activation_bits=8 if "a8" in rest else None, head_bits=head)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-0.5b-16l")
    parser.add_argument("--rows", default="int4,int4-g64,int8,int8-g64,int8-a8,int8-g32-a8,int4-a8")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="the compiled decode step (docstring)")
    parser.add_argument("--peer", choices=("llamacpp",), default=None)
    parser.add_argument("--prefill-tokens", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = 0 if args.threads == 1 else 1  # CPU time, or the wall clock with more threads
    base = load(args.model, torch.float32)
    models = {"float32": base}
    counts = {}
    for row in args.rows.split(","):
        models[row] = quantized_copy(base, config(row))
        counts[row] = kernel_counts(models[row].net)
    ids = base.encode(TEST_TEXT.read_text())[: args.prefill_tokens]  # bench packed's held-out text
    timers = decode_timers(models, args.new_tokens, torch.tensor([ids]), args.compile)
    timers = {name: timer for name, timer in timers.items() if args.peer or name.startswith("decode ")}
    with ExitStack() as stack:
        peer = None
        if args.peer:
            peer = llamacpp.start(base, args.model, len(ids), args.new_tokens, args.threads, stack)
            if not isinstance(peer, llamacpp.PeerRun):
                raise SystemExit(f"llama.cpp: {peer['reason']}")
            timers |= {name: timer for name, timer in
                       llamacpp.timers(peer, base.encode(PROMPT), args.new_tokens, ids).items()
                       if not name.endswith(" f16")}  # fmt: skip
        seconds = median_seconds(timers, args.repeats)
    speed = {name.removeprefix("decode "): args.new_tokens / s[clock] for name, s in seconds.items()
             if name.startswith("decode ")}  # fmt: skip
    fill = {name.removeprefix("prefill "): len(ids) / s[clock] for name, s in seconds.items()
            if name.startswith("prefill ")}  # fmt: skip
    rows = {name: {"decode_tok_s": round(tok_s, 2), "vs_float32": round(tok_s / speed["float32"], 2),
                   **({"prefill_tok_s": round(fill[name], 1)} if name in fill else {}),
                   **({"kernels": counts[name]} if name in counts else {})}
            for name, tok_s in speed.items()}  # fmt: skip
    pairs = [*PAIRS, *((row, fmt) for row in speed for ours, fmt in PAIRS if row.startswith(f"{ours}-h"))]
    ratios = {f"{ours} / {fmt}": {"decode": round(speed[ours] / speed[f"llama.cpp {fmt}"], 2),
                                  "prefill": round(fill[ours] / fill[f"llama.cpp {fmt}"], 2)}
              for ours, fmt in pairs if peer and ours in speed}  # fmt: skip
    head = {"model": args.model, "kernels": kernels.status().reason, "threads": args.threads,
            "clock": "process CPU" if clock == 0 else "wall", "compile": args.compile}  # fmt: skip
    head |= {"new_tokens": args.new_tokens, "prefill_tokens": len(ids), "repeats": args.repeats}
    print(json.dumps({**head, "rows": rows, **({"vs_llamacpp": ratios} if peer else {})}))


if __name__ == "__main__":
    main()
