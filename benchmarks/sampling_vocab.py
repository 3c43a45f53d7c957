"""What sampling costs a decode step at a real model's vocabulary (Qwen2.5's 151,936 tokens),
where the package's own models have 2,048: `sample_rows` (the chain's adapters, the draw,
the logprobs and the text of each row), per setting.

    python benchmarks/sampling_vocab.py [--vocab 151936] [--rows 1,16] [--calls 20]
    DECODEKIT_PEERS=.peers python benchmarks/sampling_vocab.py --peer llamacpp

The logits are those of a peaked next-token distribution, not uniform noise: each row ranks
the vocabulary in a random order and gives rank r the logit -s log r (a Zipf law; s = 1.5
puts ~0.98 of the mass on the first 1,024 tokens, s = 1.1 ~0.74, a flat one) plus Gaussian
noise of 0.5. Detokenising is stubbed (the shipped tokenizer has 2,048 tokens), so the
figure is the sampler's. One torch thread, median wall milliseconds of `calls` steps after a
warm-up; prints one JSON line per (rows, exponent, setting).

`--peer llamacpp` runs the same logits through llama.cpp's samplers in the same run
(llama-cpp-python from scripts/peers.sh; bench/llamacpp_worker.py `samplers`): the same
adapters in a chain ending in its seeded `dist` (or `greedy`), each row's candidate array
filled from its logits first, as `llama_sampler_sample` does (here with numpy). llama.cpp
computes no logprob of the chosen token; decodekit's step does.

Compare two checkouts by running it with each one's src first on PYTHONPATH, alternately.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

import decodekit as dk
from decodekit.bench.decode import machine
from decodekit.bench.llamacpp import find_llamacpp, run_worker
from decodekit.request import make_requests, sample_rows

# The same settings as chains of llama.cpp's samplers (`--peer llamacpp`).
PEER_CHAINS = {
    "temperature 1": [["dist", 1]],
    "greedy": [["greedy"]],
    "top_p 0.9": [["top_p", 0.9], ["dist", 1]],
    "top_p 0.95, temperature 0.7": [["temp", 0.7], ["top_p", 0.95], ["dist", 1]],
    "top_k 50": [["top_k", 50], ["dist", 1]],
    "min_p 0.05": [["min_p", 0.05], ["dist", 1]],
    "typical 0.9": [["typical", 0.9], ["dist", 1]],
    "llama.cpp's defaults": [["top_k", 40], ["top_p", 0.95], ["min_p", 0.05], ["temp", 0.8], ["dist", 1]],
}
SETTINGS = {
    "temperature 1": {},
    "greedy": {"temperature": 0.0},
    "top_p 0.9": {"top_p": 0.9},
    "top_p 0.95, temperature 0.7": {"top_p": 0.95, "temperature": 0.7},
    "top_k 50": {"top_k": 50},
    "min_p 0.05": {"min_p": 0.05},
    "typical 0.9": {"typical_p": 0.9},
    # llama.cpp's default chain (top-k 40, top-p 0.95, min-p 0.05, temperature 0.8), its order
    "llama.cpp's defaults": {"top_k": 40, "top_p": 0.95, "min_p": 0.05, "temperature": 0.8,
                             "order": ("top_k", "top_p", "min_p", "temperature")},
}


def zipf_logits(rows: int, vocab: int, exponent: float, generator: torch.Generator) -> torch.Tensor:
    ranks = torch.stack([torch.randperm(vocab, generator=generator) for _ in range(rows)]) + 1
    noise = torch.randn(rows, vocab, generator=generator) * 0.5
    return -exponent * ranks.double().log().float() + noise  # [R, V]


def peer_timings(peer, logits: torch.Tensor, calls: int) -> dict:
    """llama.cpp's median ms a step (all rows) for each setting, on the same logits."""
    with tempfile.TemporaryDirectory() as directory:
        path = f"{directory}/logits.f32"
        logits.contiguous().numpy().tofile(path)
        return run_worker(peer, {"op": "samplers", "logits": path, "rows": logits.shape[0], "calls": calls,
                                 "chains": PEER_CHAINS})["ms"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--exponents", default="1.5,1.1")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--settings", default=";".join(SETTINGS), help="names of SETTINGS, separated by ;")
    parser.add_argument("--peer", choices=["llamacpp"], default=None)
    args = parser.parse_args()
    peer = None
    if args.peer:
        peer = find_llamacpp()
        if peer is None:
            raise SystemExit("--peer llamacpp: no llama-cpp-python found (scripts/peers.sh, DECODEKIT_PEERS)")
    torch.set_num_threads(1)
    model = dk.load_model("shakespeare-5gram")
    model.decode = lambda ids, *a, **k: "x" * len(ids)  # the shipped tokenizer has 2,048 tokens
    generator = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        for exponent in (float(e) for e in args.exponents.split(",")):
            logits = zipf_logits(rows, args.vocab, exponent, generator)
            peer_ms = peer_timings(peer, logits, args.calls) if peer else {}
            for name, fields in SETTINGS.items():
                if name not in args.settings.split(";"):
                    continue
                params = dk.SamplingParams(seed=1, max_new_tokens=10**6, ignore_eos=True, **fields)
                requests = make_requests(model, [[1, 2]] * rows, params)
                for request in requests:
                    request.state.vocab_size = args.vocab
                live = [row for request in requests for row in request.rows]
                sample_rows(logits, live)  # warm-up
                times = []
                for _ in range(args.calls):
                    start = time.perf_counter()
                    sample_rows(logits, live)
                    times.append(time.perf_counter() - start)
                line = {"vocab": args.vocab, "rows": rows, "zipf_exponent": exponent, "setting": name,
                        "ms_per_step_median": round(statistics.median(times) * 1e3, 3), "threads": 1}
                if peer:
                    line["llamacpp_ms_per_step_median"] = peer_ms[name]
                    line["speedup_vs_llamacpp"] = round(peer_ms[name] / line["ms_per_step_median"], 2)
                print(json.dumps({**line, "machine": machine()}), flush=True)


if __name__ == "__main__":
    main()
