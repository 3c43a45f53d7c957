"""Speculative decoding's compiled steps (issue 36): `shakespeare-large` with the
`shakespeare` draft, its draft forwards and its verifications eager or compiled, beside
plain decoding eager or compiled.

One engine (compile=True; every bucket compiled in an untimed warm-up) and four modes,
toggled in-process and interleaved in every round, so they share the machine's load:

- eager: nothing compiled (the default engine of a short run: the automatic policy
  compiles only once the steps have repaid it);
- compiled decode: the engine's own decode step compiled (plain decoding's), the draft's
  forwards and the verification eager: the engine before this change;
- + draft: the draft's one-token forwards compiled too (engine/members.py, rounds.py
  `member_forward`);
- + verification: and a step that only verifies runs the target's compiled step of its
  span (compile_policy.py `CompiledSpans`).

Plain decoding runs eager and compiled; "eager" is against eager plain, the others against
compiled plain. Greedy tokens are checked equal to plain ones. CPU time of this process, one
thread, the best of --repeats rounds per configuration.

    OMP_NUM_THREADS=1 python benchmarks/speculative_draft_step.py \\
        --json benchmarks/results/speculative_draft_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import decodekit as dk
from decodekit.bench.decode import machine
from decodekit.bench.speculative import heldout_prompts
from decodekit.compress.recipe import CompressConfig, quantized_copy
from decodekit.decode.speculative import speculative_generate
from decodekit.engine.config import EngineConfig
from decodekit.engine.engine import DEFAULT_CONFIG, engine_for
from decodekit.params import SamplingParams

MODES = ("eager", "compiled decode", "+ draft", "+ verification")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="shakespeare-large")
    parser.add_argument("--draft", default="shakespeare")
    parser.add_argument("--draft-bits", type=int, choices=(4, 8), default=None,
                        help="the draft's round-to-nearest copy: int8 per channel, int4 in groups of 32")
    parser.add_argument("--configs", nargs="+", default=["0:3", "0:4", "1:4"], help="temperature:gamma")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    target, draft = dk.load_model(args.target), dk.load_model(args.draft)
    if args.draft_bits:  # its linear layers' codes and scales; embedding, norms and head stay float
        group = 32 if args.draft_bits == 4 else None
        draft = quantized_copy(draft, CompressConfig("rtn", bits=args.draft_bits, group_size=group))
    prompts = heldout_prompts(target, args.prompts)
    engine = engine_for(target, EngineConfig(**{**vars(DEFAULT_CONFIG), "compile": True}))
    configs = [(float(t), int(g)) for t, g in (c.split(":") for c in args.configs)]

    def params(temperature: float, tokens: int = args.new_tokens) -> SamplingParams:
        return SamplingParams(max_new_tokens=tokens, temperature=temperature, ignore_eos=True, seed=0)

    def plain(temperature: float) -> list[list[int]]:
        return [dk.generate(target, p, params(temperature))[0].token_ids for p in prompts]

    def speculative(temperature: float, gamma: int, stats: dict) -> list[list[int]]:
        out = []
        for prompt in prompts:
            result = speculative_generate(target, draft, prompt, params(temperature), gamma, "block",
                                          fallback=False)  # fmt: skip
            out.append(result.completions[0].token_ids)
            for key, value in vars(result.stats).items():
                stats[key] = stats.get(key, 0) + value
        return out

    # Warm-up, untimed: every bucket both models use compiles here (one row; each span the
    # configurations verify, down to the short blocks at the end of a generation).
    for prompt in prompts[:1]:
        dk.generate(target, prompt, params(0.0, 8))
        for temperature, gamma in configs:
            speculative_generate(target, draft, prompt, params(temperature), gamma, "block", fallback=False)
    member = engine.members.of(draft)
    main_step, draft_step, spans = engine.compiled, member.compiled, engine.spans
    assert main_step.lanes.ready and draft_step.lanes.ready and spans.by_span, "the warm-up compiled nothing"

    def mode(name: str) -> None:
        engine.compiled = None if name == "eager" else main_step
        member.compiled = draft_step if name in ("+ draft", "+ verification") else None
        engine.spans = spans if name == "+ verification" else None

    def cpu(fn) -> tuple[float, object]:
        start = time.process_time()
        out = fn()
        return time.process_time() - start, out

    times: dict = {}
    stats: dict = {}
    started = time.perf_counter()
    for round_ in range(args.repeats):
        for temperature in sorted({t for t, _ in configs}):
            for name in ("eager", "compiled"):
                mode(name)
                seconds, tokens = cpu(lambda: plain(temperature))  # noqa: B023 -- called at once
                times.setdefault(("plain", temperature, name), []).append(seconds)
                if temperature == 0:
                    times.setdefault(("tokens", name), tokens)
        for temperature, gamma in configs:
            for name in MODES:
                mode(name)
                key = (temperature, gamma, name)
                seconds, tokens = cpu(lambda: speculative(temperature, gamma, stats.setdefault(key, {})))  # noqa: B023
                times.setdefault(key, []).append(seconds)
                if temperature == 0:
                    assert tokens == times[("tokens", "eager")], f"greedy tokens differ in mode {name}"
        print(f"[{time.perf_counter() - started:5.0f} s] round {round_ + 1} done", flush=True)
    mode("+ verification")

    total = args.new_tokens * len(prompts)
    rows = []
    for temperature, gamma in configs:
        for name in MODES:
            reference = min(times[("plain", temperature, "eager" if name == "eager" else "compiled")])
            best = min(times[(temperature, gamma, name)])
            s = stats[(temperature, gamma, name)]
            drafted = max(s["drafted_tokens"], 1)
            rows.append({"temperature": temperature, "gamma": gamma, "mode": name,
                         "plain_ms_per_token": round(1e3 * reference / total, 2),
                         "ms_per_token": round(1e3 * best / total, 2),
                         "speedup": round(reference / best, 3),
                         "block_efficiency": round(s["emitted_tokens"] / s["target_calls"], 2),
                         "accepted": round(s["accepted_tokens"] / drafted, 3)})  # fmt: skip
    print("| T | γ | mode | plain ms/token | speculative ms/token | speedup | tokens per target call |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['temperature']:g} | {r['gamma']} | {r['mode']} | {r['plain_ms_per_token']} | "
              f"{r['ms_per_token']} | **{r['speedup']:.2f}x** | {r['block_efficiency']} |")  # fmt: skip
    if args.json:
        result = {"target": args.target, "draft": args.draft, "draft_bits": args.draft_bits,
                  "new_tokens": args.new_tokens,
                  "prompts": len(prompts), "repeats": args.repeats, "machine": machine(),
                  "load_average": os.getloadavg()[0], "rows": rows}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
