"""The eager decode step's per-token overhead (issue 39): what a batch-1 token costs beyond its
matmuls, on the engine's eager path.

A random model with qwen2.5-0.5b-16l's architecture (16 layers, q/k/v biases, tied embeddings,
the embedded tokenizer) and tiny widths (hidden 128, FFN 256, 2 heads / 1 KV head of 64), so
its matmuls take microseconds and a token's time is nearly all per-op and Python overhead,
the part that does not shrink with the weights; and optionally the real 240M shape beside it
(`--model qwen2.5-0.5b-16l`, where int4 weights make that overhead a third of a token).
Greedy, 64 new tokens after a 3-token prompt, one thread, process CPU time, median and best
of `--rounds` after a warm-up.

    python benchmarks/eager_overhead.py [--model probe] [--format float32|int4] [--rounds 8]

Compare two checkouts by running it with each one's src first on PYTHONPATH, alternately.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

import decodekit as dk
from decodekit.compress.recipe import CompressConfig, quantized_copy
from decodekit.engine.engine import DEFAULT_CONFIG, engine_for
from decodekit.models import shapes

PROBE = {**shapes.SHAPES["qwen2.5-0.5b-16l"], "hidden_size": 128, "intermediate_size": 256,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="probe", help="probe (tiny widths) or a name in models/shapes.py")
    parser.add_argument("--format", choices=("float32", "int4"), default="float32",
                        help="int4: RTN in groups of 64 (the issue's int4 row)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes.SHAPES.setdefault("probe", PROBE)
    model = shapes.random_model(args.model, torch.float32)
    if args.format == "int4":
        model = quantized_copy(model, CompressConfig("rtn", bits=4, group_size=64))
    engine_for(model, dataclasses.replace(DEFAULT_CONFIG, compile=False))
    params = dk.SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    dk.generate(model, "ROMEO:", params)  # warm-up
    per_token = []
    for _ in range(args.rounds):
        start = time.process_time()
        dk.generate(model, "ROMEO:", params)
        per_token.append((time.process_time() - start) / args.new_tokens * 1000)
    median, best = round(statistics.median(per_token), 3), round(min(per_token), 3)
    print(json.dumps({"model": args.model, "format": args.format, "threads": 1, "clock": "process CPU",
                      "new_tokens": args.new_tokens, "ms_per_token_median": median,
                      "ms_per_token_best": best}))  # fmt: skip


if __name__ == "__main__":
    main()
