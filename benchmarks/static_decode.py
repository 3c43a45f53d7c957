"""Batch-1 decoding through `StaticDecodeLM` (a gpt-fast style static-shape decode step,
eager and `torch.compile`d; models/static.py) against `generate` on the engine (issue 15
item 6; BENCHMARKS.md "Real model shapes: dtype, device and speed").

    python benchmarks/static_decode.py [--model shakespeare | --shape NAME] [--new-tokens 200]
                                       [--repeats 3] [--capacity 512]

Rows: `decodekit.generate` of the model (the paged engine), and `decodekit.generate` of
`StaticDecodeLM(model)` with the step run eagerly and compiled (the plain loop; the prompt
prefilled by the model's own forward). Every row's greedy tokens are checked against the
engine's. Tokens/s are CPU time of this process, one thread, the median of `repeats` runs
after a warm-up (the compiled row's warm-up compiles: its wall time is reported apart).
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import decodekit as dk
from decodekit.bench.decode import model_or_shape
from decodekit.models.static import StaticDecodeLM


def cpu_tok_s(fn, tokens: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return round(tokens / statistics.median(times), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="shakespeare")
    parser.add_argument("--shape", default=None, help="a random-weight model of this shape (models/shapes.py)")  # noqa: E501
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--capacity", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with model_or_shape(args.model, args.shape) as path:
        model = dk.load_model(path)
    n = args.new_tokens
    params = dk.SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    rows = {"generate": model,
            "static_eager": StaticDecodeLM(model, args.capacity, compile=False),
            "static_compiled": StaticDecodeLM(model, args.capacity)}  # fmt: skip
    reference = dk.generate(model, "ROMEO:", params)[0].token_ids
    result = {"model": args.shape or args.model, "parameters": model.num_parameters(), "new_tokens": n,
              "capacity": args.capacity, "threads": 1, "torch": torch.__version__}  # fmt: skip
    for name, row in rows.items():
        start = time.perf_counter()
        tokens = dk.generate(row, "ROMEO:", params)[0].token_ids  # warm-up (compiles)
        result[name] = {"first_run_wall_s": round(time.perf_counter() - start, 1),
                        "same_tokens_as_generate": tokens == reference}  # fmt: skip
    for name, row in rows.items():  # timed after every warm-up, in one pass
        run = lambda row=row: dk.generate(row, "ROMEO:", params)  # noqa: E731
        result[name]["cpu_tok_s"] = cpu_tok_s(run, n, args.repeats)
    for name in ("static_eager", "static_compiled"):
        result[name]["vs_generate"] = round(result[name]["cpu_tok_s"] / result["generate"]["cpu_tok_s"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
