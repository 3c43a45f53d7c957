"""What a γ = 4 verification costs against a plain step, in the model alone (issue 36).

`model.forward` of `batch` rows on a contiguous KV cache of `context` positions (one prompt's
KV forked to every row), 1 new token a row (a plain decode step) and 5 (a verification of 4
draft tokens), CPU time of the best of 5, one torch thread; no engine, no draft. If reading
the KV dominated, 5 tokens would cost about what 1 does.

    PYTHONPATH=src python benchmarks/verify_forward_cost.py --batch 16 --contexts 256 2000
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

import decodekit as dk
from decodekit.bench.long_context import context_prompts, rope_scaled_copy


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="shakespeare-large")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2000])
    parser.add_argument("--theta-factor", type=float, default=16.0, help="the copy's rope_theta multiplier")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="decodekit-verify-") as tmp:
        model = dk.load_model(rope_scaled_copy(args.model, tmp, args.theta_factor))
        for context in args.contexts:
            [prompt] = context_prompts(model, 1, context)
            with torch.inference_mode():
                one = model.new_cache(1)
                model.forward(torch.tensor([prompt], device="cpu"), one)
                cache = one.fork([0] * args.batch)
                for new in (1, 5, 1, 5):  # twice, alternated
                    ids = torch.full((args.batch, new), 7, device="cpu")
                    times = []
                    for _ in range(5):
                        start = time.process_time()
                        model.forward(ids, cache)
                        times.append(time.process_time() - start)
                        cache.crop(context)
                    print(f"batch {args.batch}, context {context}, {new} tokens a row: "
                          f"{1000 * min(times):.1f} ms", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
