"""Where an engine decode step's time goes (issue 33): wall time per step, the GPU time of one
replay of its CUDA graph, and the host's Python profile of the step.

    python scripts/gpu_step_profile.py --shape qwen2.5-0.5b --device cuda --dtype bfloat16
    python scripts/gpu_step_profile.py --model shakespeare            # the CPU, eager

For each row count (1, and 64 requests with different prompts) and on a GPU each attention
form of the graphed step (`--attention`), after the prompts' steps: the
median wall milliseconds of `Engine.step` (with the device synchronised), on a GPU the
milliseconds one replay of the largest captured graph takes (CUDA events), and the
functions that take most of the host's time over the same steps (cProfile, own time). A step
much longer than its graph's replay is bound by the host. Prints one JSON line per row count,
then the profile.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch

import decodekit as dk
from decodekit.bench.decode import model_or_shape
from decodekit.bench.engine import CONCURRENT, engine_config, prompts_from_text
from decodekit.engine import Engine
from decodekit.engine.cuda_graphs import GraphedLanes


def timed_steps(engine: Engine, steps: int, synchronize) -> list[float]:
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds


def replay_ms(engine: Engine, repeats: int = 20) -> float | None:
    """The GPU time of one replay of the engine's largest captured graph, or None."""
    graphs = getattr(engine.lanes, "graphs", None)
    if not graphs or not torch.cuda.is_available():
        return None
    graph = graphs[max(graphs)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def profile_rows(model, rows: int, steps: int, top: int, fused: bool = True) -> tuple[dict, str]:
    cuda = model.device.type == "cuda"
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    if rows == 1:
        prompts = [model.encode("ROMEO:")]
    else:
        prompts = prompts_from_text(model, rows, CONCURRENT["prompt_lengths"])
    temperature = 0 if rows == 1 else 1  # one greedy row; many sampled ones
    params = dk.SamplingParams(max_new_tokens=2 * steps + 8, seed=0, ignore_eos=True, temperature=temperature)
    engine = Engine(model, engine_config(None if cuda else False, model))
    if cuda:  # the graphed step's attention form (engine/cuda_graphs.py)
        engine.compiled.lanes = engine.lanes = GraphedLanes(model, fused_attention=fused)
    for prompt in prompts:
        engine.submit(prompt, params)
    for _ in range(6):  # the prompts, the first decode steps and their captures
        engine.step()
    seconds = timed_steps(engine, steps, synchronize)
    gpu = replay_ms(engine)
    profiler = cProfile.Profile()
    profiler.enable()
    timed_steps(engine, steps, synchronize)
    profiler.disable()
    while engine.has_work():
        engine.step()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    result = {"rows": rows, "attention": ("sdpa, writing" if fused else "written out") if cuda else "eager",
              "wall_ms_per_step": round(statistics.median(seconds) * 1e3, 3),
              "graph_replay_gpu_ms": None if gpu is None else round(gpu, 3),
              "captures": getattr(engine.lanes, "captures", None)}  # fmt: skip
    return result, text.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="an embedded model's name or a checkpoint directory")
    parser.add_argument("--shape", default=None, help="random weights of a named shape (models/shapes.py)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rows", default="1,64", help="comma-separated row counts (default 1,64)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed, then profiled")
    parser.add_argument("--top", type=int, default=18, help="functions in the profile")
    parser.add_argument("--attention", default="both", choices=("both", "sdpa", "written"),
                        help="on a GPU, the graphed step's attention form(s) (default both, alternating)")
    args = parser.parse_args(argv)
    if (args.model is None) == (args.shape is None):
        parser.error("give one of --model NAME and --shape SHAPE")
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    if not rows or min(rows) < 1 or args.steps < 1:
        parser.error(f"--rows must be positive counts and --steps >= 1, got {args.rows!r} and {args.steps}")
    torch.set_num_threads(1)
    with model_or_shape(args.model, args.shape) as name:
        model = dk.load_model(name, dtype=args.dtype, device=args.device)
        forms = {"both": (True, False), "sdpa": (True,), "written": (False,)}[args.attention]
        for count in rows:
            for fused in forms if model.device.type == "cuda" else (True,):
                result, profile = profile_rows(model, count, args.steps, args.top, fused)
                line = {"model": args.model or args.shape, "device": args.device, **result}
                print(json.dumps(line), flush=True)
                print(profile, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
