"""Contrastive decoding on the engine (issue 14) against the plain loop it replaced.

    python -m decodekit.bench.contrastive_engine [--prompts 20] [--new-tokens 64]   # prints JSON

Expert `shakespeare`, amateur `shakespeare-draft`, alpha 0.1, greedy, EOS ignored, over the
held-out prompts of `decodekit bench contrastive`. Scenarios, tokens generated per wall
second (median of `repeats` runs after one warm-up, the scenarios interleaved so that each
sees the same load):
- `plain_batched`: the plain loop over the pair's `PairCache`, every prompt in one batch
  (what `decodekit.generate` ran before contrastive programs);
- `plain_one_at_a_time`: the plain loop, one prompt after another (what the server's worker
  thread ran: one contrastive request at a time);
- `engine_batched`: `decodekit.generate` now, every prompt a `ContrastiveProgram` on the
  expert's engine, the amateur's forwards batched across them;
- `engine_concurrent_callers`: one `decodekit.generate` call per prompt, all at once from
  their own threads (a server's requests arriving separately): they batch on the engine;
- `expert_alone`: greedy on the expert alone on its engine (the bound: contrastive adds the
  amateur's forward and the scores to each step).
CPU seconds of this process are reported beside wall seconds: on a loaded machine they
distort least (one torch thread; the concurrent callers' threads take turns on the engine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch


def _plain(model, prompts, params) -> int:
    """The plain loop (decode/sample.py) over `prompts` in one batch; tokens generated."""
    from decodekit.decode.sample import _steps
    from decodekit.request import emit, make_requests

    requests = make_requests(model, prompts, params)
    for rows in _steps(model, requests):
        list(emit(rows, model.max_context))
    return sum(len(row.token_ids) for r in requests for row in r.rows)


def _generated(completions) -> int:
    return sum(len(c.token_ids) for cs in completions for c in cs)


def _concurrent(model, prompts, params) -> int:
    """One `generate` call per prompt, each from its own thread, all at once."""
    import decodekit as dk

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda prompt: dk.generate(model, [prompt], params), prompts))
    return sum(_generated(r) for r in results)


def bench_contrastive_engine(
    expert_name: str = "shakespeare",
    amateur_name: str = "shakespeare-draft",
    prompts: int = 20,
    new_tokens: int = 64,
    repeats: int = 3,
) -> dict:
    import decodekit as dk
    from decodekit.bench.contrastive import held_out_prompts
    from decodekit.bench.decode import machine

    expert, amateur = dk.load_model(expert_name), dk.load_model(amateur_name)
    cd = dk.ContrastiveLM(expert, amateur, alpha=0.1)
    assert cd.engine_programs([]) is not None, "both models must support paged KV"
    texts = held_out_prompts(prompts)
    params = dk.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    scenarios = {
        "plain_batched": lambda: _plain(cd, texts, params),
        "plain_one_at_a_time": lambda: sum(_plain(cd, [t], params) for t in texts),
        "engine_batched": lambda: _generated(dk.generate(cd, texts, params)),
        "engine_concurrent_callers": lambda: _concurrent(cd, texts, params),
        "expert_alone": lambda: _generated(dk.generate(expert, texts, params)),
    }
    times: dict[str, list[float]] = {name: [] for name in scenarios}
    cpu: dict[str, list[float]] = {name: [] for name in scenarios}
    tokens = {}
    for round_ in range(repeats + 1):  # round 0 warms up
        for name, run in scenarios.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            tokens[name] = run()
            if round_:
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    # the engine path is the plain loop's greedy search, token for token
    want = [c[0].token_ids for c in dk.generate(cd, texts, params)]
    from decodekit.decode.sample import _steps
    from decodekit.request import make_requests

    requests = make_requests(cd, texts, params)
    for _ in _steps(cd, requests):
        pass
    same = sum(r.rows[0].token_ids == w for r, w in zip(requests, want, strict=True))
    tok_s = {name: round(tokens[name] / statistics.median(t), 1) for name, t in times.items()}
    cpu_tok_s = {name: round(tokens[name] / statistics.median(t), 1) for name, t in cpu.items()}

    def ratios(rates: dict) -> dict:
        return {f"{engine}_vs_{plain}": round(rates[engine] / rates[plain], 2)
                for engine in ("engine_batched", "engine_concurrent_callers")
                for plain in ("plain_batched", "plain_one_at_a_time")}  # fmt: skip

    return {
        "expert": expert_name, "amateur": amateur_name, "prompts": len(texts),
        "new_tokens": new_tokens, "repeats": repeats, "machine": machine(),
        "tok_s": tok_s, "cpu_tok_s": cpu_tok_s, "ratios": ratios(tok_s), "cpu_ratios": ratios(cpu_tok_s),
        "wall_seconds": {name: [round(s, 3) for s in t] for name, t in times.items()},
        "prompts_with_equal_tokens": same,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(json.dumps(bench_contrastive_engine(prompts=args.prompts, new_tokens=args.new_tokens,
                                              repeats=args.repeats), indent=2))


if __name__ == "__main__":
    main()
