"""decodekit against llama.cpp on GGUF files with a real vocabulary: Qwen2.5's 151,936 tokens,
where the package's random shapes (and so `bench packed`) have the embedded tokenizer's 2,048.

    DECODEKIT_PEERS=.peers python benchmarks/real_vocab_gguf.py [--shape qwen2.5-0.5b-16l]
        [--formats q8_0,q4_0] [--rounds 2] [--new-tokens 32]

For each format: random weights of the shape with the real vocabulary (tied, as Qwen2.5-0.5B's),
written by `compress.gguf.write_gguf` (every matrix on the format's grid, `token_embd` too) into
a temporary directory; then, alternating for `rounds` rounds, greedy decode of `new_tokens`
tokens after a 3-token prompt in decodekit (the eager engine, and the compiled step after its
compilation) and in llama.cpp (llama-cpp-python from scripts/peers.sh, one worker process).
Token ids are fed and read as ids: the embedded tokenizer cannot decode ids past 2,048, so
decodekit's detokeniser is stubbed. One thread each, wall clock, median of 3 runs per round.
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import decodekit as dk
from decodekit.bench.decode import machine
from decodekit.bench.llamacpp import ABSENT, find_llamacpp
from decodekit.compress.gguf import write_gguf
from decodekit.engine.engine import DEFAULT_CONFIG, engine_for, forget_engine
from decodekit.models import shapes

VOCAB = 151_936
PROMPT = [1, 2, 3]
LLAMA = """
import sys, time, statistics
from llama_cpp import Llama
model = Llama(model_path=sys.argv[1], n_ctx=256, n_threads=1, n_batch=64, verbose=False)
tokens = int(sys.argv[2])
runs = []
for _ in range(3):
    model.reset()
    model.eval([1, 2, 3])
    start = time.perf_counter()
    for _ in range(tokens):
        model.eval([int(model.sample(temp=0.0))])
    runs.append((time.perf_counter() - start) / tokens)
print(1 / statistics.median(runs))
"""


def decodekit_speed(path: Path, new_tokens: int, compile: bool) -> float:
    """Tokens per second of greedy decode, median of 3 after a warm-up (the compilation)."""
    model = dk.load_model(str(path))
    model.decode = lambda ids, *args, **kwargs: "x" * len(ids)  # ids past the tokenizer's 2,048
    engine_for(model, dataclasses.replace(DEFAULT_CONFIG, compile=compile))
    params = dk.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    dk.generate(model, [PROMPT], params)
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        dk.generate(model, [PROMPT], params)
        runs.append((time.perf_counter() - start) / new_tokens)
    forget_engine(model)
    return 1 / statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b-16l")
    parser.add_argument("--formats", default="q8_0,q4_0")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    peer = find_llamacpp()
    if peer is None:
        sys.exit(f"real_vocab_gguf.py: {ABSENT}")
    torch.set_num_threads(1)
    results = {"shape": args.shape, "vocab": VOCAB, "threads": 1, "new_tokens": args.new_tokens}
    with tempfile.TemporaryDirectory(prefix="decodekit-real-vocab-") as folder:
        config = {**shapes.shape_config(args.shape), "vocab_size": VOCAB}
        checkpoint = shapes.save_checkpoint(config, Path(folder) / "checkpoint")
        for fmt in args.formats.split(","):
            path = write_gguf(checkpoint, Path(folder) / f"{fmt}.gguf", fmt)
            rows = {"eager": [], "compiled": [], "llama.cpp": []}
            for _ in range(args.rounds):
                rows["eager"].append(decodekit_speed(path, args.new_tokens, compile=False))
                rows["compiled"].append(decodekit_speed(path, args.new_tokens, compile=True))
                out = subprocess.run([str(peer.python), "-c", LLAMA, str(path), str(args.new_tokens)],
                                     capture_output=True, text=True, check=True).stdout  # fmt: skip
                rows["llama.cpp"].append(float(out.strip().splitlines()[-1]))
            theirs = rows["llama.cpp"]
            results[fmt] = {"tokens_per_s": {k: [round(v, 2) for v in vs] for k, vs in rows.items()}}
            for step in ("eager", "compiled"):
                ratios = [round(a / b, 2) for a, b in zip(rows[step], theirs, strict=True)]
                results[fmt][f"{step}_over_llamacpp"] = ratios
    print(json.dumps({**results, "machine": machine()}, indent=1))


if __name__ == "__main__":
    main()
