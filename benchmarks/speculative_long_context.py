"""Speculative decoding at long context: seed 001's claim, measured (issue 36).

The meta-generation tutorial (seed 001, after MagicDec, Chen et al. 2024) says speculative
decoding "can harm throughput at low context but improves both throughput and latency at
long context lengths": with a batch and a long context, reading the KV cache dominates a
decode step, and a verification reads it once for γ + 1 tokens.

For each context length (prompt tokens) and batch size: `bench_concurrent` (`decodekit bench
speculative --clients N --prompt-tokens P`): N requests of P-token prompts (windows of the
shipped validation text), greedy, EOS ignored, batched on the target's engine, speculative
(draft model, block verification; γ fixed with the per-row fallback and without it
("always"), the adaptive rule, γ = 1) against the same N requests decoded plainly, each the
best of --repeats interleaved runs, in CPU and wall time of this process; then each of
--single-prompts requests alone (batch 1). Speculative tokens must equal plain greedy tokens
(asserted on every run). The prompts' KV is cached (target and draft) before the timed runs,
so they time decoding, not prefill.

The models have 512 positions. Past that both run as RoPE-scaled copies made here in a
temporary directory (`long_context.rope_scaled_copy`: rope_theta x --theta-factor, the shipped
files untouched); at a context that fits 512 the shipped pair runs too, and the scaled pair
beside it (the same models at both lengths).

    PYTHONPATH=src python benchmarks/speculative_long_context.py \\
        --contexts 256 2000 --batches 8 16 --json benchmarks/results/speculative_long_context.json
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time

import torch

from decodekit.bench.long_context import rope_scaled_copy
from decodekit.bench.speculative import bench_concurrent


def tail_perplexity(path: str, window: int, windows: int = 4, scored: int = 256) -> float:
    """Perplexity of the last `scored` tokens of `windows` windows of `window` tokens spread over
    the shipped test text: what the model makes of positions up to `window` (a probe, 1,024
    tokens scored at the defaults; `decodekit eval perplexity` is the full measure)."""
    import decodekit as dk
    from decodekit.compress.evaluate import HELD_OUT
    from decodekit.models.base import score_batch

    model = dk.load_model(path)
    ids = model.encode(HELD_OUT["test"].read_text())
    step = (len(ids) - window) // windows
    rows = [ids[i * step : i * step + window] for i in range(windows)]
    with torch.inference_mode():
        nll = -sum(float(s.sum()) for row in rows for s in score_batch(model, [row], [window - scored]))
    return round(math.exp(nll / (windows * scored)), 2)


def point(label: str, target: str, draft: str, context: int, batch: int, args) -> dict:
    out = bench_concurrent(target, draft, batch, args.new_tokens, args.gamma, args.repeats,
                           args.single_prompts, threads=1, prompt_tokens=context)  # fmt: skip
    out["pair"] = label
    return out


def rows(result: dict) -> list[str]:
    """Table lines of one (pair, context, batch) point: each speculative configuration batched,
    then γ with and without the fallback for requests alone (batch 1)."""
    g, single = result["single"]["gamma"], result["single"]
    names = {f"gamma{g}": f"γ={g}", f"gamma{g}_always": f"γ={g} always", f"gamma{g}_adaptive": "adaptive",
             "gamma1_always": "γ=1 always"}  # fmt: skip
    head = f"| {result['prompt_tokens']} | {result['pair']} | "

    def line(batch, plain_tok_s, plain_ms, name, r):
        ms = "" if r.get("cpu_ms_per_step") is None else f"{r['cpu_ms_per_step']:.0f}"
        return (f"{head}{batch} | {plain_tok_s:.0f} | {plain_ms} | {name} | {r['acceptance_rate']:.2f} | "
                f"{r['block_efficiency']:.2f} | {ms} | **{r['speedup_cpu']:.2f}x** | {r['speedup']:.2f}x |")

    plain, plain_ms = result["plain"], f"{result['plain']['cpu_ms_per_step']:.0f}"
    lines = [line(result["concurrent"], plain["cpu_tok_s"], plain_ms, name, result[key])
             for key, name in names.items()]  # fmt: skip
    lines += [line(1, single["plain"]["cpu_tok_s"], "", names[key], single[key])
              for key in (f"gamma{g}", f"gamma{g}_always")]  # fmt: skip
    return lines


HEADER = ["| context | pair | batch | plain tok/s (CPU) | plain ms/step | speculative | accept rate | "
          "block eff. | ms/step | speedup (CPU) | speedup (wall) |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="shakespeare-large")
    parser.add_argument("--draft", default="shakespeare")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2000], help="prompt tokens")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--single-prompts", type=int, default=2)
    parser.add_argument("--theta-factor", type=float, default=16.0, help="the copies' rope_theta multiplier")
    parser.add_argument("--positions", type=int, default=2304, help="the copies' max_position_embeddings")
    parser.add_argument("--no-shipped", action="store_true", help="the scaled pair only, at every context")
    parser.add_argument("--no-scaled-short", action="store_true",
                        help="at a context the shipped pair fits, not the scaled pair beside it")
    parser.add_argument("--json", default=None, help="write the results here (after every point)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start, results = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix="decodekit-longctx-") as tmp:
        scaled = (f"theta x{args.theta_factor:g}", str(rope_scaled_copy(args.target, tmp, args.theta_factor,
                                                                        args.positions)),
                  str(rope_scaled_copy(args.draft, tmp, args.theta_factor, args.positions)))  # fmt: skip
        quality = {f"{name} {label}, positions < {window}": tail_perplexity(path, window)
                   for name, shipped, copy in ((args.target, args.target, scaled[1]),
                                               (args.draft, args.draft, scaled[2]))
                   for label, path, windows in (("shipped", shipped, (512,)),
                                                (scaled[0], copy, (512, args.positions - 256)))
                   for window in windows}  # fmt: skip
        print("perplexity, last 256 tokens of 4 windows of the test text:", json.dumps(quality, indent=1))
        for context in args.contexts:
            fits = context + args.new_tokens + args.gamma <= 512
            pairs = [("shipped", args.target, args.draft)] if fits and not args.no_shipped else []
            if not (fits and pairs and args.no_scaled_short):
                pairs.append(scaled)
            for batch in args.batches:
                for label, target, draft in pairs:
                    result = point(label, target, draft, context, batch, args)
                    result["tail_perplexity"] = quality
                    results.append(result)
                    print(f"[{time.perf_counter() - start:6.0f} s] {rows(result)[0]}", flush=True)
                    if args.json:
                        with open(args.json, "w") as f:
                            json.dump(results, f, indent=1)
    print("\n".join(HEADER + [line for r in results for line in rows(r)]))


if __name__ == "__main__":
    main()
