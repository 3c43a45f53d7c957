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

`--shared N:P[,N:P...]` also times N seeded samples of one P-token prompt with the prompt's KV
shared (engine/rows.py: on a GPU the prefixed graph, forced here whatever `shares` says) and
with every row holding its whole sequence, alternating, median wall milliseconds a decode
step: where on this device sharing starts to pay (rows.py GPU_SHARE_MIN_BYTES, an estimate
until such a run).
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
from decodekit.engine import rows as engine_rows
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


def shared_prefix_ms(model, samples: int, length: int, steps: int, rounds: int = 2) -> dict:
    """Median wall milliseconds of a decode step of `samples` samples of one `length`-token
    prompt, its KV shared and not (module docstring)."""
    cuda = model.device.type == "cuda"
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    [prompt] = prompts_from_text(model, 1, [length])
    params = dk.SamplingParams(n=samples, max_new_tokens=steps + 8, seed=0, ignore_eos=True, temperature=1)
    times: dict[str, list[float]] = {"shared": [], "whole rows": []}
    threshold = engine_rows.GPU_SHARE_MIN_BYTES
    engine_rows.GPU_SHARE_MIN_BYTES = 0  # a GPU shares whatever the size; the CPU always does
    try:
        for _ in range(rounds):
            for form, seconds in times.items():
                engine = Engine(model, engine_config(None if cuda else False, model))
                engine.running_kv.share_prefixes = form == "shared"
                engine.submit(prompt, params)
                for _ in range(4):  # the prompt, the first decode steps and their captures
                    engine.step()
                assert (engine.running_kv.prefixes[0] is not None) == (form == "shared")
                seconds += timed_steps(engine, steps, synchronize)
    finally:
        engine_rows.GPU_SHARE_MIN_BYTES = threshold
    return {form: round(statistics.median(s) * 1e3, 3) for form, s in times.items()}


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
    parser.add_argument("--shared", default="", metavar="N:P[,N:P...]",
                        help="also time N samples of a P-token prompt, its KV shared and not")
    args = parser.parse_args(argv)
    if (args.model is None) == (args.shape is None):
        parser.error("give one of --model NAME and --shape SHAPE")
    counts = [int(r) for r in args.rows.split(",") if r.strip()]
    if not counts or min(counts) < 1 or args.steps < 1:
        parser.error(f"--rows must be positive counts and --steps >= 1, got {args.rows!r} and {args.steps}")
    try:
        shared = [tuple(int(x) for x in item.split(":")) for item in args.shared.split(",") if item.strip()]
    except ValueError:
        shared = [()]
    if any(len(item) != 2 or min(item) < 2 for item in shared):
        parser.error(f"--shared must be N:P pairs of at least 2 samples and 2 tokens, got {args.shared!r}")
    torch.set_num_threads(1)
    with model_or_shape(args.model, args.shape) as name:
        model = dk.load_model(name, dtype=args.dtype, device=args.device)
        forms = {"both": (True, False), "sdpa": (True,), "written": (False,)}[args.attention]
        for count in counts:
            for fused in forms if model.device.type == "cuda" else (True,):
                result, profile = profile_rows(model, count, args.steps, args.top, fused)
                line = {"model": args.model or args.shape, "device": args.device, **result}
                print(json.dumps(line), flush=True)
                print(profile, flush=True)
        for samples, length in shared:
            ms = shared_prefix_ms(model, samples, length, args.steps)
            print(json.dumps({"model": args.model or args.shape, "device": args.device, "samples": samples,
                              "prompt_tokens": length, "wall_ms_per_step": ms,
                              "shared_over_whole": round(ms["shared"] / ms["whole rows"], 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
