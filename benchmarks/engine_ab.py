"""Issue 24's speed check: the engine's per-request cost before and after a change, in one
process per side, run alternately (`PYTHONPATH=<checkout>/src python benchmarks/engine_ab.py`
for each checkout; DECODEKIT_KERNELS=0 to leave the CPU kernels out). Prints the best of 5
CPU times (s) of: one greedy request of 128 tokens; 64 seeded requests of 32 tokens at
once; 16 beam searches (4 beams); 16 speculative requests with `shakespeare-draft`."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch

import decodekit as dk
from decodekit.decode.beam import beam_search
from decodekit.decode.speculative import speculative_generate


def best_cpu_seconds(run: Callable[[], object], repeats: int = 5) -> float:
    """The least CPU time of `repeats` runs after one warm-up."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        run()
        best = min(best, time.process_time() - start)
    return round(best, 4)


def main() -> None:
    torch.set_num_threads(1)
    model, draft = dk.load_model("shakespeare"), dk.load_model("shakespeare-draft")
    prompts = [f"ROMEO {i}:" for i in range(64)]
    greedy = dk.SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)
    seeded = dk.SamplingParams(temperature=1, max_new_tokens=32, ignore_eos=True, seed=1)
    cases = {
        "single": lambda: dk.generate(model, ["ROMEO:"], greedy.replace(max_new_tokens=128)),
        "concurrent64": lambda: dk.generate(model, prompts, seeded),
        "beam16": lambda: beam_search(model, prompts[:16], greedy, num_beams=4),
        "spec16": lambda: speculative_generate(model, draft, prompts[:16], seeded, 4),
    }
    print(json.dumps({name: best_cpu_seconds(run) for name, run in cases.items()}))


if __name__ == "__main__":
    main()
