"""Size `shakespeare-large` by measurement (issue 36): training throughput and decode cost per shape.

For each candidate shape in train_lm.py's CONFIGS (random weights; nothing is trained):

- training: CPU seconds per optimizer step on windows of the whole 512-token context, in
  float32 and under bfloat16 autocast (the two alternate step by step), as tokens per
  CPU-second; CPU time (`time.process_time`), not wall time, because the machine is shared;
- decode: through decodekit's native forward (`load_model`, dtype "auto"), batch 1 on a
  128-position KV cache: the best CPU time of a 1-token forward (a plain decode step) and of
  a 5-token forward (a speculative verification of 4 drafted tokens), with the weights'
  bytes over the 1-token time as an effective bandwidth. The shipped `shakespeare` is the
  baseline, timed in the same run;
- the acceptance α a draft needs for 2.0x and 1.6x (the issue's goals at T = 0 and 1), from
  Leviathan et al.'s expected speedup with the measured cost ratios (`alpha_needed`), for
  the drafts `shakespeare` and `shakespeare-draft`.

One torch thread.

    python scripts/size_lm.py --configs shakespeare-large-s shakespeare-large shakespeare-large-xl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_lm import ASSETS, CONFIGS, build_model, make_optimizer  # noqa: E402


def train_step_seconds(model, batch_size: int, seq_len: int, steps: int, dtypes) -> dict[str, float]:
    """Median CPU seconds of one optimizer step in float32 and/or under bfloat16 autocast."""
    optimizer = make_optimizer(model, 1e-4)
    times: dict[str, list[float]] = {name: [] for name in dtypes}
    gen = torch.Generator().manual_seed(0)
    for i in range(steps + 1):
        for name in times:
            ids = torch.randint(0, model.config.vocab_size, (batch_size, seq_len + 1), generator=gen)
            start = time.process_time()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name == "bfloat16"):
                logits = model(input_ids=ids[:, :-1]).logits  # [B, T, V]
            loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if i:  # the first step of each warms up
                times[name].append(time.process_time() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def decode_seconds(path: str, repeats: int) -> dict:
    """Best CPU seconds of a 1-token and a 5-token forward on a 128-position cache."""
    import decodekit as dk
    from decodekit.bench.latency import filled_cache, time_forward

    model = dk.load_model(path)
    cache = filled_cache(model, 1, 128, 8)
    one, _ = time_forward(model, cache, 1, repeats)
    five, _ = time_forward(model, cache, 5, repeats)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.net.parameters())
    return {"dtype": str(model.dtype).removeprefix("torch."), "weight_mb": weight_bytes / 1e6,
            "decode_ms": 1000 * one, "verify5_ms": 1000 * five, "verify5_over_decode": five / one,
            "gb_per_s": weight_bytes / one / 1e9}


def speedup(alpha: float, gamma: int, cost: float, verify: float) -> float:
    """Leviathan et al.'s expected speedup: (1 - α^(γ+1)) / (1 - α) tokens per block, each
    block costing γ draft steps (`cost` of a target step each) and one verification of γ + 1
    tokens (`verify` target steps)."""
    tokens = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens / (gamma * cost + verify)


def alpha_needed(goal: float, cost: float, verify5: float, max_gamma: int = 16) -> tuple[float, int]:
    """The smallest acceptance α at which some γ <= max_gamma reaches `goal`x, and that γ.
    Verification of γ + 1 tokens costs 1 + (verify5 - 1) * γ / 4 target steps (linear through
    the measured 5-token forward)."""
    best = (1.0, max_gamma)
    for gamma in range(1, max_gamma + 1):
        verify = 1 + (verify5 - 1) * gamma / 4
        if speedup(1.0, gamma, cost, verify) < goal:
            continue
        lo, hi = 0.0, 1.0
        for _ in range(40):  # speedup rises with α: bisect
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if speedup(mid, gamma, cost, verify) < goal else (lo, mid)
        best = min(best, (hi, gamma))
    return best


def rounded(row: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", required=True, choices=sorted(CONFIGS))
    parser.add_argument("--batch-size", type=int, default=2, help="training windows per timed step")
    parser.add_argument("--train-steps", type=int, default=2, help="timed steps per dtype (0: decode only)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16"], help="training: float32, bfloat16 autocast")
    parser.add_argument("--decode-repeats", type=int, default=30)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "shakespeare")
    results = []
    baseline = decode_seconds("shakespeare", args.decode_repeats)
    draft_ms = decode_seconds("shakespeare-draft", args.decode_repeats)["decode_ms"]
    print("shakespeare (baseline):", json.dumps(rounded(baseline)), flush=True)
    for name in args.configs:
        cfg = CONFIGS[name]
        model = build_model(cfg, tokenizer)
        n_params = sum(p.numel() for p in model.parameters())
        row = {"config": name, "parameters": n_params}
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            base_again = decode_seconds("shakespeare", args.decode_repeats)  # interleaved baseline
            row |= decode_seconds(tmp, args.decode_repeats)
            row["decode_over_shakespeare"] = row["decode_ms"] / base_again["decode_ms"]
        for draft, ms in (("shakespeare", base_again["decode_ms"]), ("shakespeare-draft", draft_ms)):
            for goal in (2.0, 1.6):
                alpha, gamma = alpha_needed(goal, ms / row["decode_ms"], row["verify5_over_decode"])
                row[f"alpha_for_{goal}x_{draft}"] = f"{alpha:.2f} (gamma {gamma})"
        if args.train_steps:
            step = train_step_seconds(model, args.batch_size, cfg.seq_len, args.train_steps, args.dtypes)
            tokens = args.batch_size * cfg.seq_len
            row |= {f"train_tokens_per_cpu_s_{k}": tokens / v for k, v in step.items()}
            if len(step) == 2:
                row["bf16_over_fp32_speed"] = step["float32"] / step["bfloat16"]
        results.append(row)
        print(json.dumps(rounded(row)), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"baseline": baseline, "shapes": results}, indent=1))


if __name__ == "__main__":
    main()
