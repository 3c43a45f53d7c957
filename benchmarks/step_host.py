"""The engine's own time in a decode step: everything a step costs outside the model's forward
(issue 33: a GPU step at 64 rows waits on this host work).

    python benchmarks/step_host.py [--rows 1,16,64] [--steps 48] [--rounds 5]
        [--model probe | NAME] [--logprobs K] [--top-p P]

`rows` requests with different prompts (16-128 tokens, cut from the shipped text), seeded
sampling at temperature 1 unless told otherwise, on an eager engine (the step the CPU and
a GPU's eager path run). After their prompts' steps, `steps` decode steps are timed in
process CPU time, and so is the model's forward inside each (`Engine._forward` wrapped):
the difference is the engine's part, scheduling, batch building, sampling, logprobs,
detokenisation and deltas, which graph capture on a GPU does not remove. The default model
is `probe`: qwen2.5-0.5b-16l's architecture at tiny widths with 2 layers, so its forward is
short and the rest of the step stands out. One torch thread, the garbage collector left on
(its pauses are part of a step's cost), each request's deltas taken after every step as a
server's streams take them. Median and best of `rounds` fresh engines; prints
one JSON line per row count.

Compare two checkouts by running it with each one's src first on PYTHONPATH, alternately.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import decodekit as dk
from decodekit.bench.decode import machine
from decodekit.bench.engine import prompts_from_text
from decodekit.engine import Engine, EngineConfig
from decodekit.models import shapes

PROBE = {**shapes.SHAPES["qwen2.5-0.5b-16l"], "hidden_size": 128, "intermediate_size": 256,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
         "num_hidden_layers": 2}  # fmt: skip


def one_round(model, rows: int, steps: int, params: dk.SamplingParams) -> dict:
    """CPU seconds of `steps` decode steps and of the forwards inside them, on a fresh engine."""
    engine = Engine(model, EngineConfig(max_running=max(rows, 1), max_kv_bytes=64 * 2**20, compile=False))
    prompts = prompts_from_text(model, rows, [16, 32, 64, 128])
    handles = [engine.submit(prompt, params) for prompt in prompts]
    while engine.scheduler.waiting or engine.inbox.incoming or any(
        not entry.started for entry in engine.scheduler.running
    ):
        engine.step()
    engine.step()  # every row decoding
    forward, inner = [0.0], engine._forward

    def timed_forward(*args):
        start = time.process_time()
        try:
            return inner(*args)
        finally:
            forward[0] += time.process_time() - start

    engine._forward = timed_forward
    start = time.process_time()
    for _ in range(steps):
        engine.step()
        for handle in handles:
            handle.poll()  # a reader takes each step's deltas, as a server's streams do
    total = time.process_time() - start
    assert len(engine.running_kv) == rows, "every row still decodes in the timed steps"
    return {"step": total / steps, "forward": forward[0] / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="probe",
                        help="probe (tiny widths), a shape in models/shapes.py, or a model")
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--logprobs", type=int, default=None, help="top logprobs asked for each token")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes.SHAPES.setdefault("probe", PROBE)
    if args.model in shapes.SHAPES:
        model = shapes.random_model(args.model, torch.float32)
    else:
        model = dk.load_model(args.model)
    params = dk.SamplingParams(max_new_tokens=args.steps + 16, seed=0, ignore_eos=True,
                               logprobs=args.logprobs, top_p=args.top_p, temperature=args.temperature)
    one_round(model, 2, 4, params)  # warm-up
    for rows in (int(r) for r in args.rows.split(",")):
        rounds = [one_round(model, rows, args.steps, params) for _ in range(args.rounds)]
        host = [(r["step"] - r["forward"]) * 1e3 for r in rounds]
        print(json.dumps({
            "model": args.model, "rows": rows, "steps": args.steps, "logprobs": args.logprobs,
            "top_p": args.top_p, "temperature": args.temperature, "threads": 1, "clock": "process CPU",
            "ms_per_step_median": round(statistics.median(r["step"] * 1e3 for r in rounds), 3),
            "forward_ms_per_step_median": round(statistics.median(r["forward"] * 1e3 for r in rounds), 3),
            "host_ms_per_step_median": round(statistics.median(host), 3),
            "host_ms_per_step_best": round(min(host), 3),
            "host_us_per_row_median": round(statistics.median(host) / rows * 1e3, 1),
            "machine": machine(),
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
