"""Beam search over a ContrastiveLM (shakespeare against shakespeare-draft): on the expert's
engine (`beam_search`: a BeamProgram per prompt, the amateur in a member pool) against the
plain loop (`_beam_plain` over the pair's dense caches), issue 24.

    python benchmarks/contrastive_beam.py

Four prompts, num_beams 4, 64 new tokens; CPU seconds of this process, one thread, the
median of 3 runs after a warm-up; checks that both paths keep the same best beams. Prints
one JSON document.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

import decodekit as dk
from decodekit.decode.beam import _beam_plain, beam_searches
from decodekit.decode.contrastive import ContrastiveLM

PROMPTS = ["ROMEO:\n", "JULIET:\n", "KING HENRY:\n", "First Citizen:\n"]


def main() -> None:
    torch.set_num_threads(1)
    cd = ContrastiveLM(dk.load_model("shakespeare"), dk.load_model("shakespeare-draft"), alpha=0.1)
    params = dk.SamplingParams(max_new_tokens=64)
    paths = {
        "plain": lambda: [_beam_plain(cd, s) for s in beam_searches(cd, PROMPTS, params, num_beams=4)],
        "engine": lambda: dk.beam_search(cd, PROMPTS, params, num_beams=4),
    }
    out = {}
    for name, run in paths.items():
        best = [c[0] for c in run()]  # warm-up
        times = []
        for _ in range(3):
            start = time.process_time()
            run()
            times.append(time.process_time() - start)
        out[name] = (statistics.median(times), [c.token_ids for c in best], [c.score for c in best])
    print(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "prompts": len(PROMPTS), "num_beams": 4, "new_tokens": 64,
        "plain_cpu_s": round(out["plain"][0], 3), "engine_cpu_s": round(out["engine"][0], 3),
        "speedup": round(out["plain"][0] / out["engine"][0], 2),
        "same_tokens": out["plain"][1] == out["engine"][1],
        "max_score_difference": max(abs(a - b) for a, b in zip(out["plain"][2], out["engine"][2],
                                                                 strict=True)),
    }, indent=1))


if __name__ == "__main__":
    main()
