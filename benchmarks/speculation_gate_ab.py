"""The speculation gate's parameters against the former ones, plain decoding and speculating at
every step, on the engine, in alternated rounds (one torch thread, process CPU time).

    python benchmarks/speculation_gate_ab.py --requests 1 --new-tokens 256
    python benchmarks/speculation_gate_ab.py --requests 16 --new-tokens 128 --workload copy

`--requests` greedy requests in one call (held-out prompts with the target's draft, or
`--workload copy`: prompts that repeat their text, with prompt lookup), γ = 4, block
verification. Each round runs plain decoding, the gate with the current parameters, with the
former ones (decay 0.5, a prior of one rejected position, no margin), and no gate; greedy
output is checked against plain decoding's. Prints each configuration's best CPU seconds, its
speedup over plain decoding's best, and its plain steps (JSON).
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext
from unittest import mock

import torch

import decodekit as dk
from decodekit.bench.decode import machine
from decodekit.bench.speculative import bench_params, copy_prompts, heldout_prompts
from decodekit.decode import speculation_gate
from decodekit.decode.speculative import speculative_generate

FORMER = {"DECAY": 0.5, "PRIOR": (0.0, 1.0), "CONFIDENCE": 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="shakespeare-large")
    parser.add_argument("--draft", default="shakespeare-large-draft")
    parser.add_argument("--requests", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--workload", choices=("heldout", "copy"), default="heldout")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = dk.load_model(args.target)
    if args.workload == "heldout":
        prompts, drafter = heldout_prompts(target, args.requests), dk.load_model(args.draft)
    else:
        prompts, drafter = copy_prompts(target, args.requests), "prompt-lookup"
    params = bench_params(args.new_tokens, 0.0)
    want = [c[0].token_ids for c in dk.generate(target, prompts, params)]  # and a warm-up
    configs = {"gate": {}, "former_gate": FORMER, "always": None}
    seconds: dict[str, list[float]] = {}
    plain_steps: dict[str, int] = {}
    for _ in range(args.rounds):
        start = time.process_time()
        dk.generate(target, prompts, params)
        seconds.setdefault("plain", []).append(time.process_time() - start)
        for name, patch in configs.items():
            former = mock.patch.multiple(speculation_gate, **patch) if patch else nullcontext()
            with former:
                start = time.process_time()
                result = speculative_generate(
                    target, drafter, prompts, params, 4, "block", fallback=patch is not None
                )
                seconds.setdefault(name, []).append(time.process_time() - start)
            assert [c[0].token_ids for c in result.completions] == want, "speculative greedy != plain greedy"
            plain_steps[name] = result.stats.plain_steps
    plain = min(seconds["plain"])
    out = {"machine": machine(), "target": args.target, "workload": args.workload, "requests": args.requests,
           "new_tokens": args.new_tokens, "rounds": args.rounds}  # fmt: skip
    for name, runs in seconds.items():
        out[name] = {"cpu_s": [round(s, 3) for s in runs], "speedup": round(plain / min(runs), 3)}
        if name in plain_steps:
            out[name]["plain_steps"] = plain_steps[name]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
