"""`decodekit bench engine`: the paged engine vs Hugging Face `generate()`, same weights, same run.

Scenarios (issue 4):
1. `single`: batch 1, greedy, `new_tokens` new tokens (EOS ignored);
2. `shared_prefix`: 16 samples of one long prompt, 128 new tokens each, temperature 1;
   the engine prefills the prompt once (its prefill token count is reported beside the
   16 x prompt tokens that `generate(num_return_sequences=16)` computes);
3. `concurrent`: 64 requests with different prompts submitted at once, 128 new tokens
   each; throughput, and the fraction of the machine's peak matmul FLOP/s it reaches:
   generated tokens/s x 2 x parameters / the best FLOP/s of a 1024^3 matmul measured in
   this run with the same threads (both in wall time and both in CPU time);
4. `memory`: resident memory of scenario 3, each backend in a fresh process: the peak
   during the run (sampled every 2 ms) and what the run adds to the loaded model.

`compile` (`--compile`): decodekit's engines run the compiled decode step (engine/compiled.py),
compiled by the warm-up run (its time reported as `compile_warmup_s`) and shared by the
engines of every repeat; False (the default here) measures the eager step.

Every time is taken twice: wall clock, and CPU time of this process (`time.process_time`),
which is what a shared, oversubscribed machine distorts least when one thread runs.
Each figure is the median of `repeats` runs after one warm-up, ours and Hugging Face's
alternating so that both see the same load.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import resource
import statistics
import threading
import time
from collections.abc import Callable

import torch

from decodekit.bench.decode import hf_generation, load_pair, machine
from decodekit.runtime import progress as progress_bar
from decodekit.runtime import within_unit

SCENARIOS = ("single", "shared_prefix", "concurrent", "memory")


def compare(ours, theirs, repeats: int, on_progress: Callable[[float], None] | None = None,
            ) -> tuple[dict, dict]:
    """Median wall and CPU seconds of `ours()` and `theirs()`, run alternately (after one
    warm-up each) so that both see the same load on a shared machine; `on_progress`: the
    share of the rounds done, after each."""
    ours(), theirs()
    runs: dict[str, list[dict]] = {"ours": [], "theirs": []}
    for i in range(repeats):
        if on_progress is not None:
            on_progress((i + 1) / (repeats + 1))
        runs["ours"].append(timed_once(ours))
        runs["theirs"].append(timed_once(theirs))
    if on_progress is not None:
        on_progress(1.0)
    return tuple(  # type: ignore[return-value]
        {key: statistics.median(r[key] for r in runs[side]) for key in ("wall_s", "cpu_s")}
        for side in ("ours", "theirs")
    )


def peak_matmul_flops(size: int = 1024, repeats: int = 10) -> dict:
    """Best FLOP/s of a float32 [size, size] @ [size, size] matmul (the machine's peak),
    per second of wall time and per second of this process's CPU time."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    runs = [timed_once(lambda: a @ b) for _ in range(repeats)]
    flops = 2 * size**3
    return {"wall": flops / min(r["wall_s"] for r in runs),
            "cpu": flops / min(r["cpu_s"] for r in runs)}  # fmt: skip


def timed_once(fn) -> dict:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}


def prompts_from_text(model, count: int, lengths: list[int]) -> list[list[int]]:
    """`count` different token prompts of the given lengths, cut from the shipped val text."""
    from decodekit.models.registry import ASSETS

    needed = sum(lengths[i % len(lengths)] for i in range(count))
    ids = model.encode((ASSETS / "data" / "shakespeare_val.txt").read_text()[: 8 * needed])
    out, start = [], 0
    for i in range(count):
        length = lengths[i % len(lengths)]
        out.append(ids[start : start + length])
        start += length
    assert all(len(p) == lengths[i % len(lengths)] for i, p in enumerate(out))
    return out


def run_engine(model, prompts, params, config=None) -> dict:
    """Submit every prompt, step until done; the engine's stats."""
    from decodekit.engine import Engine

    engine = Engine(model, config or engine_config(False))
    handles = [engine.submit(prompt, params) for prompt in prompts]
    while not all(h.done for h in handles):
        engine.step()
    for handle in handles:
        assert all(len(c.token_ids) == params.max_new_tokens for c in handle.result(0))
    return engine.stats()


def engine_config(compile: bool | None, model=None):
    """The benchmark's engine: 64 rows a step, and a KV pool that holds the 64 concurrent
    requests of `CONCURRENT` all running, as transformers' batch holds them (a bound of 64 MiB
    held 13 of 64 at a time, median, at llama-3.2-1b's KV shape: the scenario ran 606 steps
    for 129), or the device's bound where that is larger (engine/config.py)."""
    from decodekit.engine import EngineConfig
    from decodekit.engine.block_pool import block_bytes

    config = EngineConfig(max_running=64, compile=compile)
    if model is None:
        return config
    c = model.config
    positions = max(CONCURRENT["prompt_lengths"]) + CONCURRENT["new_tokens"]
    block = block_bytes(c.num_layers, config.block_size, c.num_kv_heads, c.head_dim, model.dtype)
    needed = config.blocks_holding(CONCURRENT["requests"], positions) * block
    return dataclasses.replace(config, max_kv_bytes=max(needed, config.kv_bytes_for(model.device)))


def run_hf(hf, prompts, new_tokens: int, sample: bool, num_return_sequences: int = 1, pad=0, **fields):
    """transformers' `generate()`; `fields`: more GenerationConfig fields (a static cache)."""
    from decodekit.models.base import left_pad

    tokens, mask = (t.to(hf.device) for t in left_pad(prompts, pad))
    with torch.inference_mode():
        config = hf_generation(new_tokens, sample, pad, num_return_sequences=num_return_sequences, **fields)
        out = hf.generate(tokens, attention_mask=mask.long(), generation_config=config)
    assert out.shape == (len(prompts) * num_return_sequences, tokens.shape[1] + new_tokens)


def _ratios(ours: dict, theirs: dict, tokens: int) -> dict:
    return {
        "decodekit_tok_s": round(tokens / ours["wall_s"], 1),
        "hf_tok_s": round(tokens / theirs["wall_s"], 1),
        "ratio": round(theirs["wall_s"] / ours["wall_s"], 2),
        "decodekit_cpu_tok_s": round(tokens / ours["cpu_s"], 1),
        "hf_cpu_tok_s": round(tokens / theirs["cpu_s"], 1),
        "cpu_ratio": round(theirs["cpu_s"] / ours["cpu_s"], 2),
    }


def bench_engine(
    model_name: str = "shakespeare",
    new_tokens: int = 256,
    repeats: int = 3,
    threads: int = 1,
    scenarios: tuple[str, ...] = SCENARIOS,
    progress: bool = False,
    dtype: str = "auto",
    device: str = "cpu",
    compile: bool | None = False,
) -> dict:
    """The chosen scenarios (module docstring), decodekit against transformers, both in
    `dtype` on `device`; `progress`: a bar over the scenarios on stderr. compile: the
    engine's (EngineConfig.compile): False eager; None automatic (on a GPU, decode steps
    replayed from CUDA graphs: engine/cuda_graphs.py); True compiled."""
    import decodekit as dk

    torch.set_num_threads(threads)
    model, hf = load_pair(model_name, dtype, device)
    eos = model.eos_token_ids[0] if model.eos_token_ids else 0
    params_count = model.num_parameters()
    config = engine_config(compile, model)
    results: dict = {"model": model_name, "parameters": params_count, "machine": machine(),
                     "dtype": str(hf.dtype).removeprefix("torch."), "repeats": repeats,
                     "compile": compile}  # fmt: skip
    bar = progress_bar(total=len(set(scenarios) & set(SCENARIOS)), desc="bench engine", enabled=progress)
    if "single" in scenarios:
        bar.set_postfix_str("single")
        prompt = [model.encode("ROMEO:")]
        greedy = dk.SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
        warmup = timed_once(lambda: run_engine(model, prompt, greedy, config))["wall_s"]
        ours, theirs = compare(lambda: run_engine(model, prompt, greedy, config),
                               lambda: run_hf(hf, prompt, new_tokens, False, pad=eos), repeats,
                               within_unit(bar))
        results["single"] = {"new_tokens": new_tokens, **_ratios(ours, theirs, new_tokens),
                             **({"compile_warmup_s": round(warmup, 2)} if compile else {})}  # fmt: skip
        if model.device.type == "cuda":  # transformers' fastest path, and the step's host syncs
            ours, static = compare(lambda: run_engine(model, prompt, greedy, config),
                                   lambda: run_hf(hf, prompt, new_tokens, False, pad=eos,
                                                  cache_implementation="static"), repeats)  # fmt: skip
            results["single"]["hf_static_cache"] = _ratios(ours, static, new_tokens)
            results["single"]["host_syncs_per_step"] = host_syncs_per_step(model, config)
    if "shared_prefix" in scenarios:
        bar.set_postfix_str("shared_prefix")
        samples, generated = 16, 128
        length = min(512, model.max_context - generated)  # the prompt and its samples fit
        [prompt] = prompts_from_text(model, 1, [length])
        params = dk.SamplingParams(max_new_tokens=generated, n=samples, seed=0, ignore_eos=True)
        stats = {}
        ours, theirs = compare(lambda: stats.update(run_engine(model, [prompt], params, config)),
                               lambda: run_hf(hf, [prompt], generated, True, samples, eos), repeats,
                               within_unit(bar))
        results["shared_prefix"] = {
            "prompt_tokens": length, "samples": samples, "new_tokens": generated,
            **_ratios(ours, theirs, samples * generated),
            "decodekit_prefill_tokens": stats["prefill_tokens"],
            "hf_prefill_tokens": samples * length,
        }  # fmt: skip
    if "concurrent" in scenarios:
        bar.set_postfix_str("concurrent")
        results["concurrent"] = _concurrent(dk, model, hf, eos, params_count, repeats, config,
                                            within_unit(bar))
    if "memory" in scenarios:
        bar.set_postfix_str("memory")
        results["memory"] = {backend: _in_fresh_process(model_name, backend, threads, dtype, device)
                             for backend in ("decodekit", "hf")}  # fmt: skip
        bar.update()
    bar.close()
    return results


def host_syncs_per_step(model, config, steps: int = 16) -> dict:
    """Host synchronisations per decode-only step on a GPU, counted by CUDA's sync debug mode
    (`torch.cuda.set_sync_debug_mode`: every synchronising call warns), for one greedy row
    and four seeded samples with top-p and logprobs; the mean over `steps` steps after the
    prompt's and the first decode steps (which capture the graphs)."""
    import warnings

    import decodekit as dk
    from decodekit.engine import Engine

    runs = {"greedy": dk.SamplingParams(max_new_tokens=steps + 4, temperature=0, ignore_eos=True),
            "top_p_4_samples_logprobs": dk.SamplingParams(max_new_tokens=steps + 4, n=4, top_p=0.9,
                                                          seed=0, logprobs=2, ignore_eos=True)}  # fmt: skip
    counts = {}
    for name, params in runs.items():
        engine = Engine(model, config)
        engine.submit(model.encode("ROMEO:"), params)
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(steps):
                    engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        counts[name] = round(len(syncs) / steps, 2)
        while engine.has_work():
            engine.step()
    return counts


CONCURRENT = {"requests": 64, "new_tokens": 128, "prompt_lengths": [16, 32, 64, 96, 128]}


def _concurrent(dk, model, hf, eos, params_count, repeats, config, on_progress) -> dict:
    spec = CONCURRENT
    prompts = prompts_from_text(model, spec["requests"], spec["prompt_lengths"])
    params = dk.SamplingParams(max_new_tokens=spec["new_tokens"], seed=0, ignore_eos=True)
    generated = spec["requests"] * spec["new_tokens"]
    prompt_tokens = sum(len(p) for p in prompts)
    ours, theirs = compare(lambda: run_engine(model, prompts, params, config),
                           lambda: run_hf(hf, prompts, spec["new_tokens"], True, pad=eos), repeats,
                           on_progress)
    peak = peak_matmul_flops()
    flops = 2 * params_count  # per token
    return {
        **spec, "prompt_tokens": prompt_tokens, **_ratios(ours, theirs, generated),
        "peak_matmul_gflop_s": round(peak["wall"] / 1e9, 1),
        "peak_matmul_cpu_gflop_s": round(peak["cpu"] / 1e9, 1),
        "fraction_of_peak": round(generated / ours["wall_s"] * flops / peak["wall"], 3),
        "fraction_of_peak_cpu_time": round(generated / ours["cpu_s"] * flops / peak["cpu"], 3),
        "fraction_of_peak_with_prompts_cpu_time": round(
            (generated + prompt_tokens) / ours["cpu_s"] * flops / peak["cpu"], 3),
        "hf_fraction_of_peak_cpu_time": round(
            generated / theirs["cpu_s"] * flops / peak["cpu"], 3),
    }  # fmt: skip


def _in_fresh_process(model_name: str, backend: str, threads: int, dtype: str, device: str) -> dict:
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        return pool.apply(_memory_of_concurrent, (model_name, backend, threads, dtype, device))


def _memory_of_concurrent(model_name: str, backend: str, threads: int, dtype: str, device: str) -> dict:
    """Peak RSS (MiB) of one run of scenario 3, and what it adds to the loaded model's RSS."""
    import decodekit as dk

    torch.set_num_threads(threads)
    model = dk.load_model(model_name, dtype=dtype, device=device)
    spec = CONCURRENT
    prompts = prompts_from_text(model, spec["requests"], spec["prompt_lengths"])
    eos = model.eos_token_ids[0] if model.eos_token_ids else 0
    if backend == "hf":
        del model
        hf = load_pair(model_name, dtype, device)[1]
        before, peak, _ = _peak_rss(lambda: run_hf(hf, prompts, spec["new_tokens"], True, pad=eos))
        extra = {}
    else:
        params = dk.SamplingParams(max_new_tokens=spec["new_tokens"], seed=0, ignore_eos=True)
        before, peak, stats = _peak_rss(lambda: run_engine(model, prompts, params))
        mib = stats["block_bytes"] / 2**20
        extra = {"kv_pool_mib": round(stats["total_blocks"] * mib, 1),
                 "kv_peak_used_mib": round(stats["peak_used_blocks"] * mib, 1),
                 "running_rows_mib": round(stats["running_rows_bytes"] / 2**20, 1)}  # fmt: skip
    return {"peak_rss_mib": round(peak, 1), "rss_before_run_mib": round(before, 1),
            "added_by_run_mib": round(peak - before, 1), **extra}  # fmt: skip


def _peak_rss(fn) -> tuple[float, float, object]:
    """RSS before `fn()` and its peak while it runs (MiB, sampled by a thread), and its result."""
    before = _rss_mib()
    peak = [before]
    done = threading.Event()

    def sample():
        while not done.wait(0.002):
            peak[0] = max(peak[0], _rss_mib())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = fn()
    finally:
        done.set()
        sampler.join()
    return before, max(peak[0], _rss_mib()), result


def _rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        pages = int(handle.read().split()[1])
    return pages * resource.getpagesize() / 2**20
