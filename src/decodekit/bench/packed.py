"""`decodekit bench packed`: decode and prefill speed of float32, bfloat16 and packed int8 /
int4 models (models/qlinear.py's kernels), and the quantised self-draft (issue 15, items 3
and 5).

Two models: an embedded one by name (`shakespeare`, 3.4M parameters), and a random one
with a real model's layer shapes (`--model qwen2.5-0.5b-16l`: Qwen2.5-0.5B's hidden 896,
intermediate 4864, 14 heads / 2 KV heads of 64, q/k/v biases, tied embeddings, with 16 of
its 24 layers and the vocabulary reduced to the embedded tokenizer's 2,048 ids so that it
tokenises text: 240M parameters, `random_model`). Rows: float32; bfloat16 (labelled with
what dtype "auto" loads a bfloat16 checkpoint as on this CPU, models/dtype_probe.py); int8
RTN with one scale per channel and in groups of 64 and 128 (a layer whose input width the
group does not divide stays float: `kernels` counts them); int8 GPTQ (per channel); int4 GPTQ
(per channel); and the activation-quantised rows (`activation_bits=8`, "a8": W8A8 / W4A8, the
numerics of llama.cpp's q8_0 / q4_0): int8 RTN per channel and in groups of 32 (q8_0's grid),
int4 GPTQ. GPTQ calibrates on the shipped Shakespeare validation split (`calib_windows`
windows of `calib_length` tokens).

Per row, batch 1, `threads` torch threads, median of `repeats`: greedy decode tokens/s through
`decodekit.generate` (`new_tokens` tokens after a 3-token prompt, EOS ignored) and prefill
tokens/s of one `forward` over `prefill_tokens` tokens of held-out text, the rounds interleaved
over the rows (`median_seconds`). The clock: with one thread the CPU time of the process
(`time.process_time`, so other jobs on a shared machine do not count; wall-clock figures
beside it), with more the wall clock (CPU time would add up the threads, spin-waits
included). On the embedded model also the held-out test perplexity (`text_perplexity`, the
BENCHMARKS.md protocol).
Then speculative decoding at T = 0 (`speculative_generate`, γ = 4) of the float32 model
with its own int4 copy as the draft ("self-int4": RTN, groups of 32; and the int4 GPTQ row's
model), against plain greedy decoding of the float32 model, same tokens.

With `peer="llamacpp"`, llama.cpp's f32, f16, q8_0 and q4_0 GGUFs of the same weights, each
loaded in its own worker process with the same thread count, are timed by the same protocol in
the same rounds as decodekit's rows, so a change of load moves both alike, and the ratios of
the pairs reported (bench/llamacpp.py; "peer" in the JSON says when the peer is not installed).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch

from decodekit.bench import llamacpp
from decodekit.bench.decode import machine
from decodekit.compress.recipe import CompressConfig
from decodekit.models.dtype_probe import cpu_bfloat16_dtype
from decodekit.models.shapes import SHAPES, random_model

QUANT_ROWS: dict[str, CompressConfig] = {
    "int8 RTN": CompressConfig("rtn", bits=8),
    "int8 RTN g64": CompressConfig("rtn", bits=8, group_size=64),
    "int8 RTN g128": CompressConfig("rtn", bits=8, group_size=128),
    "int8 GPTQ": CompressConfig("gptq", bits=8),
    "int4 GPTQ": CompressConfig("gptq", bits=4),
    # Opt-in activation quantisation (W8A8 / W4A8, llama.cpp's q8_0 / q4_0 numerics):
    # "int8 RTN g32 a8" is q8_0's own grid (int8 codes and one scale per block of 32).
    "int8 RTN a8": CompressConfig("rtn", bits=8, activation_bits=8),
    "int8 RTN g32 a8": CompressConfig("rtn", bits=8, group_size=32, activation_bits=8),
    "int4 GPTQ a8": CompressConfig("gptq", bits=4, activation_bits=8),
}
PROMPT = "ROMEO:"


def load(model_name: str, dtype: torch.dtype) -> Any:
    """The float model: a random one of a named shape, or an embedded / local one."""
    if model_name in SHAPES:
        return random_model(model_name, dtype)
    from decodekit.models.registry import load_model

    return load_model(model_name, backend="native", dtype=dtype)


Timer = Callable[[], tuple[float, float]]  # runs once; returns its (CPU, wall) seconds


def local(fn: Callable[[], Any]) -> Timer:
    """A timer of `fn` in this process."""

    def run() -> tuple[float, float]:
        cpu, wall = time.process_time(), time.perf_counter()
        fn()
        return time.process_time() - cpu, time.perf_counter() - wall

    return run


def median_seconds(timers: dict[str, Timer], repeats: int,
                   on_progress: Callable[[float], None] | None = None) -> dict[str, tuple[float, float]]:
    """Median (CPU, wall) seconds of each timer over `repeats` rounds after one warm-up each;
    the rounds interleave the timers, so a change of load on a shared machine hits them alike.
    `on_progress`: the share of the runs done, after each."""
    runs, done = len(timers) * (repeats + 1), 0

    def ran() -> None:
        nonlocal done
        done += 1
        if on_progress is not None:
            on_progress(done / runs)

    for timer in timers.values():
        timer()
        ran()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in timers}
    for _ in range(repeats):
        for name, timer in timers.items():
            times[name].append(timer())
            ran()
    return {name: (statistics.median(c for c, _ in t), statistics.median(w for _, w in t))
            for name, t in times.items()}  # fmt: skip


def decode_timers(models: dict[str, Any], new_tokens: int, prefill: torch.Tensor,
                  compile: bool = False) -> dict[str, Timer]:  # fmt: skip
    """The "decode NAME" and "prefill NAME" timers of each model (module docstring); each
    model's persistent engine with the compiled decode step on or off (`compile`: compiled
    by the warm-up round), so the rounds time one path."""
    import dataclasses

    import decodekit as dk
    from decodekit.engine.engine import DEFAULT_CONFIG, engine_for

    params = dk.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    timers: dict[str, Timer] = {}
    for name, model in models.items():
        if model.supports_paged_kv:
            engine_for(model, dataclasses.replace(DEFAULT_CONFIG, compile=compile))
        timers[f"decode {name}"] = local(lambda m=model: dk.generate(m, PROMPT, params))
        timers[f"prefill {name}"] = local(lambda m=model: m.forward(prefill, m.new_cache(1)))
    return timers


def speeds(seconds: dict[str, tuple[float, float]], names: list[str], new_tokens: int, prefill_tokens: int,
           wall: bool) -> dict[str, dict]:  # fmt: skip
    """Tokens/s of each name's "decode NAME" and "prefill NAME" seconds, by the wall clock or
    by CPU time (then with the wall-clock figures beside them)."""
    clock = 1 if wall else 0
    out = {}
    for name in names:
        decode, prefill = seconds[f"decode {name}"], seconds[f"prefill {name}"]
        row = {"decode_tok_s": round(new_tokens / decode[clock], 2),
               "prefill_tok_s": round(prefill_tokens / prefill[clock], 1)}  # fmt: skip
        if not wall:
            row["wall_decode_tok_s"] = round(new_tokens / decode[1], 2)
            row["wall_prefill_tok_s"] = round(prefill_tokens / prefill[1], 1)
        out[name] = row
    return out


def group_fits(model: Any, group_size: int | None) -> bool:
    """Whether a quantisation in groups of `group_size` applies to any of `model`'s layers
    (compress/apply.py leaves a layer whose input width the group does not divide in float)."""
    from decodekit.compress.apply import find_linears

    widths = [layer.in_features for layer in find_linears(model.net).values()]
    return group_size is None or any(width % group_size == 0 for width in widths)


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
    compile: bool = False,
) -> dict:
    """The rows and the speculative comparison of the module docstring, as a JSON-able dict.
    `compile`: decodekit's decode runs the engine's compiled decode step (engine/compiled.py).
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
    from decodekit.runtime import within_unit

    if peer not in (None, "llamacpp"):
        raise ValueError(f"peer must be None or 'llamacpp', got {peer!r}")
    random = model_name in SHAPES
    perplexity = not random if perplexity is None else perplexity
    calib_windows = calib_windows or (8 if random else 128)
    calib_length = calib_length or (256 if random else None)
    wall = threads > 1  # the clock (module docstring)
    auto = str(cpu_bfloat16_dtype()).removeprefix("torch.")  # what "auto" makes of a bf16 checkpoint
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    names = ["float32", "bfloat16", *QUANT_ROWS]  # the rows, then their timings and speculative's
    bar = progress_bar(total=len(names) + 2, desc="bench packed", enabled=progress)
    try:
        base = load(model_name, torch.float32)
        ids = base.encode(TEST_TEXT.read_text())
        if len(ids) < prefill_tokens or base.max_context < prefill_tokens:
            raise ValueError(f"prefill_tokens must fit the text and the context, got {prefill_tokens}")
        prefill = torch.tensor([ids[:prefill_tokens]])  # [1, T]
        rows: list[dict] = []
        models: dict[str, Any] = {}
        for name in names:
            bar.set_postfix_str(name)
            row: dict[str, Any] = {"config": name}
            if name in QUANT_ROWS and not group_fits(base, QUANT_ROWS[name].group_size):
                rows.append({**row, "skipped": f"no layer's input width is a multiple of "
                                                  f"{QUANT_ROWS[name].group_size}"})  # fmt: skip
                bar.update()
                continue
            if name == "float32":
                model = base
            elif name == "bfloat16":
                model = load(model_name, torch.bfloat16)
                row["auto_loads_a_bf16_checkpoint_as"] = auto
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
            bar.update()
        bar.set_postfix_str("timings")
        with ExitStack() as stack:
            timers = decode_timers(models, new_tokens, prefill, compile)
            run = None
            if peer == "llamacpp":
                run = llamacpp.start(base, model_name, prefill_tokens, new_tokens, threads, stack)
                if isinstance(run, llamacpp.PeerRun):
                    timers |= llamacpp.timers(run, base.encode(PROMPT), new_tokens, ids[:prefill_tokens])
            seconds = median_seconds(timers, repeats, within_unit(bar))
            measured = speeds(seconds, list(models), new_tokens, prefill_tokens, wall)
            reference = measured["float32"]
            for row in rows:
                if row["config"] in measured:
                    row.update(measured[row["config"]])
                    row["decode_vs_f32"] = round(row["decode_tok_s"] / reference["decode_tok_s"], 2)
                    row["prefill_vs_f32"] = round(row["prefill_tok_s"] / reference["prefill_tok_s"], 2)
            peers = {}
            if isinstance(run, llamacpp.PeerRun):
                formats = [f"llama.cpp {fmt}" for fmt in run.sessions]
                peer_speeds = speeds(seconds, formats, new_tokens, prefill_tokens, wall)
                auto_row = "bfloat16" if auto == "bfloat16" else "float32"
                peers[peer] = llamacpp.peer_report(run, base, new_tokens, peer_speeds, rows, auto_row)
            elif peer:
                peers[peer] = run
        int4_gptq = models["int4 GPTQ"]
        del models

        bar.set_postfix_str("speculative")
        step = within_unit(bar)
        params = dk.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        [plain] = dk.generate(base, PROMPT, params)
        drafters = {"self-int4 (RTN g32)": self_draft(base), "self int4 GPTQ": ModelDrafter(int4_gptq)}
        timers = {"plain": local(lambda: dk.generate(base, PROMPT, params))}
        speculative: dict[str, Any] = {"gamma": 4}
        for name, drafter in drafters.items():
            # fallback=False: speculation itself, every step (speculation_gate.py switches it off)
            result = dk.speculative_generate(base, drafter, PROMPT, params, 4, fallback=False)
            assert result.completions[0].token_ids == plain.token_ids, name  # exact at T = 0
            timers[name] = local(lambda d=drafter: dk.speculative_generate(base, d, PROMPT, params, 4,
                                                                           fallback=False))
            speculative[name] = {"acceptance_rate": round(result.stats.acceptance_rate, 3),
                                 "block_efficiency": round(result.stats.block_efficiency, 2)}  # fmt: skip
        medians = median_seconds(timers, repeats, step)
        seconds = {name: pair[1 if wall else 0] for name, pair in medians.items()}
        speculative["plain_f32_tok_s"] = round(new_tokens / seconds["plain"], 2)
        for name in drafters:
            speculative[name]["tok_s"] = round(new_tokens / seconds[name], 2)
            speculative[name]["vs_plain_f32"] = round(seconds["plain"] / seconds[name], 2)
        report_machine = machine()
    finally:
        bar.close()
        torch.set_num_threads(previous)
    return {"model": model_name, "parameters": base.num_parameters(), "new_tokens": new_tokens,
            "prefill_tokens": prefill_tokens, "repeats": repeats, "calib_windows": calib_windows,
            "threads": threads, "compile": compile, "clock": "wall" if wall else "process CPU time",
            "machine": report_machine,
            "dtype_auto": {"bfloat16_checkpoint": auto}, "rows": rows, "speculative_t0": speculative,
            **({"peer": peers} if peer else {})}  # fmt: skip
