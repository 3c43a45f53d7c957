"""Where a batch-1 decode token's time goes: the matmuls against everything else (issue 25).

    python benchmarks/decode_split.py [--model shakespeare | --shape qwen2.5-0.5b-16l]
        [--quant int4|int8|none] [--tokens 128] [--repeats 3]

For the engine's eager step and its compiled decode step (engine/compiled.py), in the same
run and interleaved: the wall time of a decode token (greedy, `tokens` new tokens after a
3-token prompt, on a fresh engine whose compiled buckets are already built), and the time of
the token's matmuls alone: every linear layer of the model (and the LM head) called on one
row as the decode step calls it (`models/native.py` `_linear`, `QuantizedLinear.forward`),
all of them in order, as one token's pass, repeated. "outside" is the rest: attention,
norms, RoPE, the sampler, the engine's bookkeeping and Python. One torch thread. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import decodekit as dk
from decodekit.bench.decode import machine
from decodekit.compress.recipe import CompressConfig, quantized_copy
from decodekit.engine import Engine, EngineConfig
from decodekit.models.native import _linear
from decodekit.models.qlinear import QuantizedLinear
from decodekit.models.shapes import random_model


def matmul_seconds(model, repeats: int = 30) -> float:
    """Seconds of one token's linear layers, each called on one row as decoding calls it, in
    the model's order (so each layer's weights come from memory as in a decode step, not from
    a cache warmed by repeating one layer)."""
    layers = [m for m in model.net.modules() if isinstance(m, torch.nn.Linear | QuantizedLinear)]
    calls = []
    for layer in layers:
        x = torch.randn(1, 1, layer.in_features, dtype=model.dtype)
        if isinstance(layer, QuantizedLinear):
            calls.append(lambda x=x, layer=layer: layer(x))
        else:
            calls.append(lambda x=x, layer=layer: _linear(layer, x, False))
    runs = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for call in calls:
                call()
            runs.append(time.perf_counter() - start)
    return statistics.median(runs[1:])


def token_seconds(model, compile: bool, tokens: int) -> float:
    params = dk.SamplingParams(max_new_tokens=tokens, temperature=0, ignore_eos=True)
    engine = Engine(model, EngineConfig(compile=compile))
    start = time.perf_counter()
    handle = engine.submit("ROMEO:", params)
    while engine.has_work():
        engine.step()
    handle.result(0)
    assert not compile or engine.compiled.steps >= tokens - 2
    return (time.perf_counter() - start) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--shape", default=None, help="a random model of these shapes (models/shapes.py)")
    parser.add_argument("--quant", choices=("none", "int8", "int4"), default="none")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = random_model(args.shape) if args.shape else dk.load_model(args.model or "shakespeare")
    if args.quant != "none":
        bits = 4 if args.quant == "int4" else 8
        model = quantized_copy(model, CompressConfig("rtn", bits=bits, group_size=32 if bits == 4 else None))
    start = time.perf_counter()
    token_seconds(model, True, 8)  # builds the compiled bucket of one row
    warmup = time.perf_counter() - start
    token_seconds(model, False, 8)
    runs: dict[str, list[float]] = {"eager": [], "compiled": [], "matmuls": []}
    for _ in range(args.repeats):
        runs["eager"].append(token_seconds(model, False, args.tokens))
        runs["compiled"].append(token_seconds(model, True, args.tokens))
        runs["matmuls"].append(matmul_seconds(model))
    ms = {name: statistics.median(values) * 1e3 for name, values in runs.items()}
    report = {"model": args.shape or args.model or "shakespeare", "quant": args.quant, "tokens": args.tokens,
              "repeats": args.repeats, "threads": 1, "machine": machine(),
              "compile_warmup_s": round(warmup, 1), "matmul_ms": round(ms["matmuls"], 3)}
    for path in ("eager", "compiled"):
        outside = ms[path] - ms["matmuls"]
        report[path] = {"token_ms": round(ms[path], 3), "tok_s": round(1e3 / ms[path], 1),
                        "outside_ms": round(outside, 3), "outside_share": round(outside / ms[path], 3)}
    report["compiled_over_eager"] = round(ms["eager"] / ms["compiled"], 2)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
