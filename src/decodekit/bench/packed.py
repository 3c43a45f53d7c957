"""`decodekit bench packed`: decode and prefill speed of float32, bfloat16 and packed int8 /
int4 models (models/qlinear.py's kernels), and the quantised self-draft (issue 15, items 3
and 5).

Two models: an embedded one by name (`shakespeare`, 3.4M parameters), and a random one
with a real model's layer shapes (`--model qwen2.5-0.5b-16l`: Qwen2.5-0.5B's hidden 896,
intermediate 4864, 14 heads / 2 KV heads of 64, q/k/v biases, tied embeddings, with 16 of
its 24 layers and the vocabulary reduced to the embedded tokenizer's 2,048 ids so that it
tokenises text: 240M parameters, `random_model`). Rows: float32; bfloat16; int8 RTN and
GPTQ (one scale per channel); int4 GPTQ (per channel). GPTQ calibrates on the shipped
Shakespeare validation split (`calib_windows` windows of `calib_length` tokens).

Per row, batch 1, CPU time of this process (`time.process_time`, so other jobs on a shared
machine do not count), median of `repeats`: greedy decode tokens/s through
`decodekit.generate` (`new_tokens` tokens after a 3-token prompt, EOS ignored) and prefill
tokens/s of one `forward` over `prefill_tokens` tokens of held-out text, the rounds interleaved
over the rows (`cpu_seconds`). On the embedded
model also the held-out test perplexity (`text_perplexity`, the BENCHMARKS.md protocol).
Then speculative decoding at T = 0 (`speculative_generate`, γ = 4) of the float32 model
with its own int4 copy as the draft ("self-int4": RTN, groups of 32; and the int4 GPTQ row's
model), against plain greedy decoding of the float32 model, same tokens.

With `peer="llamacpp"`, llama.cpp's f32, f16, q8_0 and q4_0 GGUFs of the same weights are
timed by the same protocol right after the rows, and their ratios reported
(bench/llamacpp.py; "peer" in the JSON says when the peer is not installed).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from decodekit.bench.decode import machine
from decodekit.compress.recipe import CompressConfig
from decodekit.models.shapes import SHAPES, random_model

QUANT_ROWS: dict[str, CompressConfig] = {
    "int8 RTN": CompressConfig("rtn", bits=8),
    "int8 GPTQ": CompressConfig("gptq", bits=8),
    "int4 GPTQ": CompressConfig("gptq", bits=4),
}
PROMPT = "ROMEO:"


def load(model_name: str, dtype: torch.dtype) -> Any:
    """The float model: a random one of a named shape, or an embedded / local one."""
    if model_name in SHAPES:
        return random_model(model_name, dtype)
    from decodekit.models.registry import load_model

    return load_model(model_name, backend="native", dtype=dtype)


def cpu_seconds(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median CPU seconds of each function over `repeats` rounds after one warm-up each; the
    rounds interleave the functions, so a change of load on a shared machine hits them alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.process_time()
            fn()
            times[name].append(time.process_time() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def speeds(models: dict[str, Any], new_tokens: int, prefill: torch.Tensor, repeats: int) -> dict[str, dict]:
    """Greedy decode and prefill tokens/s of each model (module docstring), interleaved."""
    import decodekit as dk

    params = dk.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    fns: dict[str, Callable[[], Any]] = {}
    for name, model in models.items():
        fns[f"decode {name}"] = lambda m=model: dk.generate(m, PROMPT, params)
        fns[f"prefill {name}"] = lambda m=model: m.forward(prefill, m.new_cache(1))
    seconds = cpu_seconds(fns, repeats)
    return {name: {"decode_tok_s": round(new_tokens / seconds[f"decode {name}"], 2),
                   "prefill_tok_s": round(prefill.shape[1] / seconds[f"prefill {name}"], 1)}
            for name in models}  # fmt: skip


def bench_packed(
    model_name: str = "shakespeare",
    new_tokens: int = 32,
    repeats: int = 3,
    prefill_tokens: int = 400,
    calib_windows: int | None = None,
    calib_length: int | None = None,
    threads: int = 1,
    perplexity: bool | None = None,
    progress: bool = False,
    peer: str | None = None,
) -> dict:
    """The rows and the speculative comparison of the module docstring, as a JSON-able dict.
    `perplexity` defaults to on for embedded models and off for random ones; GPTQ calibrates
    on 128 windows of 512 tokens (BENCHMARKS.md "Compression") for embedded models, 8 of
    256 for random ones (a float32 forward of the 240M model runs ~170 tokens/s)."""
    from dataclasses import replace

    import decodekit as dk
    from decodekit.compress.evaluate import TEST_TEXT, text_perplexity
    from decodekit.compress.recipe import quantized_copy
    from decodekit.decode.drafters import ModelDrafter, self_draft
    from decodekit.models.qlinear import kernel_counts
    from decodekit.runtime import progress as progress_bar

    if peer not in (None, "llamacpp"):
        raise ValueError(f"peer must be None or 'llamacpp', got {peer!r}")
    random = model_name in SHAPES
    perplexity = not random if perplexity is None else perplexity
    calib_windows = calib_windows or (8 if random else 128)
    calib_length = calib_length or (256 if random else None)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        base = load(model_name, torch.float32)
        ids = base.encode(TEST_TEXT.read_text())
        if len(ids) < prefill_tokens or base.max_context < prefill_tokens:
            raise ValueError(f"prefill_tokens must fit the text and the context, got {prefill_tokens}")
        prefill = torch.tensor([ids[:prefill_tokens]])  # [1, T]
        rows: list[dict] = []
        models: dict[str, Any] = {}
        names = ["float32", "bfloat16", *QUANT_ROWS]
        bar = progress_bar(names, desc="bench packed", enabled=progress)
        for name in bar:
            bar.set_postfix_str(name)
            row: dict[str, Any] = {"config": name}
            if name == "float32":
                model = base
            elif name == "bfloat16":
                model = load(model_name, torch.bfloat16)
            else:
                config = replace(QUANT_ROWS[name], calib_windows=calib_windows, calib_length=calib_length)
                start = time.perf_counter()
                model = quantized_copy(base, config)
                row["compress_s"] = round(time.perf_counter() - start, 1)
                row["kernels"] = kernel_counts(model.net)
            if perplexity:
                row["perplexity"] = round(text_perplexity(model).perplexity, 3)
            rows.append(row)
            models[name] = model
        for row, measured in zip(rows, speeds(models, new_tokens, prefill, repeats).values(), strict=True):
            row.update(measured)
        int4_gptq = models["int4 GPTQ"]
        del models
        reference = rows[0]
        for row in rows:
            row["decode_vs_f32"] = round(row["decode_tok_s"] / reference["decode_tok_s"], 2)
            row["prefill_vs_f32"] = round(row["prefill_tok_s"] / reference["prefill_tok_s"], 2)
        peers = {}
        if peer == "llamacpp":
            from decodekit.bench.llamacpp import bench_llamacpp

            peers[peer] = bench_llamacpp(base, model_name, PROMPT, new_tokens, ids[:prefill_tokens],
                                         repeats, rows)  # fmt: skip

        params = dk.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        [plain] = dk.generate(base, PROMPT, params)
        drafters = {"self-int4 (RTN g32)": self_draft(base), "self int4 GPTQ": ModelDrafter(int4_gptq)}
        fns: dict[str, Callable[[], Any]] = {"plain": lambda: dk.generate(base, PROMPT, params)}
        speculative: dict[str, Any] = {"gamma": 4}
        for name, drafter in drafters.items():
            result = dk.speculative_generate(base, drafter, PROMPT, params, 4)
            assert result.completions[0].token_ids == plain.token_ids, name  # exact at T = 0
            fns[name] = lambda d=drafter: dk.speculative_generate(base, d, PROMPT, params, 4)
            speculative[name] = {"acceptance_rate": round(result.stats.acceptance_rate, 3),
                                 "block_efficiency": round(result.stats.block_efficiency, 2)}  # fmt: skip
        seconds = cpu_seconds(fns, repeats)
        speculative["plain_f32_tok_s"] = round(new_tokens / seconds["plain"], 2)
        for name in drafters:
            speculative[name]["tok_s"] = round(new_tokens / seconds[name], 2)
            speculative[name]["vs_plain_f32"] = round(seconds["plain"] / seconds[name], 2)
        report_machine = machine()
    finally:
        torch.set_num_threads(previous)
    return {"model": model_name, "parameters": base.num_parameters(), "new_tokens": new_tokens,
            "prefill_tokens": prefill_tokens, "repeats": repeats, "calib_windows": calib_windows,
            "clock": "process CPU time", "machine": report_machine, "rows": rows,
            "speculative_t0": speculative, **({"peer": peers} if peer else {})}  # fmt: skip
