"""`decodekit bench dtype`: float32 against bfloat16 (and transformers float32) on one model,
same weights, same run (issue 15, items 1 and 4).

Per dtype, through `load_model(dtype=...)`: prefill tokens/s of one `prompt_tokens`-token
prompt, batch-1 greedy decode tokens/s (`new_tokens` after a short prompt, EOS ignored), and
the engine's concurrent throughput at each batch size of `batches` (that many requests at
once, prompts of 16 to 128 tokens as `bench engine`'s concurrent scenario, `batch_new_tokens`
each, temperature 1). Transformers in float32 runs the same three beside them. Times are CPU
time of this process (`time.process_time`: what a shared machine distorts least with one
thread) and wall time, medians of `repeats` runs after one warm-up, the backends alternating.

`dtypes` may also name compressed copies of the float32 model ("int8-rtn", "int8-gptq",
"int4-gptq": bench/packed.py's rows, run through PyTorch's packed int8/int4 kernels; GPTQ
calibrates on 8 windows of 256 tokens of a random model, packed.py's default for embedded
ones). Each engine batch row also reports its fraction of peak: the weights' FLOPs of every
token it processed (2 x parameters per token, prompts included) per CPU second, against a
one-thread GEMM of the model's widest layer (256 x hidden @ hidden x intermediate) timed in
the same run in float32 (float32 rows) or bfloat16 (the others, whose matmuls past 64 rows
are bfloat16 GEMMs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from decodekit.bench.decode import load_pair, machine
from decodekit.bench.engine import CONCURRENT, prompts_from_text, run_engine, run_hf, timed_once
from decodekit.runtime import progress as progress_bar
from decodekit.runtime import within_unit


def _median(fn, repeats: int, on_progress: Callable[[float], None] | None = None) -> dict:
    """Median wall and CPU seconds of `repeats` runs after a warm-up; `on_progress`: the
    share of the runs done, after each."""
    fn()  # warm-up
    runs = []
    for i in range(repeats):
        if on_progress is not None:
            on_progress((i + 1) / (repeats + 1))
        runs.append(timed_once(fn))
    if on_progress is not None:
        on_progress(1.0)
    return {key: sorted(r[key] for r in runs)[len(runs) // 2] for key in ("wall_s", "cpu_s")}


def _rates(seconds: dict, tokens: int) -> dict:
    return {"tok_s": round(tokens / seconds["wall_s"], 1), "cpu_tok_s": round(tokens / seconds["cpu_s"], 1)}


def gemm_peak_gflops(hidden: int, intermediate: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """GFLOP/s of one [256, hidden] @ [hidden, intermediate] matmul in `dtype` (CPU time, median)."""
    a, b = torch.randn(256, hidden, dtype=dtype), torch.randn(hidden, intermediate, dtype=dtype)
    seconds = _median(lambda: a @ b, repeats)["cpu_s"]
    return 2 * 256 * hidden * intermediate / seconds / 1e9


def _model(name: str, model_name: str, device: str, float32: Any) -> Any:
    """`load_model` in dtype `name`, or a compressed copy of the float32 model (QUANT_ROWS)."""
    from dataclasses import replace

    from decodekit.bench.packed import QUANT_ROWS
    from decodekit.compress.recipe import quantized_copy
    from decodekit.models.shapes import SHAPES

    quantised = {row.lower().replace(" ", "-"): config for row, config in QUANT_ROWS.items()}
    if name not in quantised:
        import decodekit as dk

        return dk.load_model(model_name, dtype=name, device=device)
    if float32 is None:
        raise ValueError(f"dtype {name!r} is a compressed copy of the float32 model: list float32 first")
    windows = {"calib_windows": 8, "calib_length": 256} if model_name in SHAPES or "/" in model_name else {}
    return quantized_copy(float32, replace(quantised[name], **windows))


def bench_dtype(
    model_name: str,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    new_tokens: int = 64,
    prompt_tokens: int = 400,
    batches: tuple[int, ...] = (16, 64),
    batch_new_tokens: int = 32,
    repeats: int = 2,
    device: str = "cpu",
    progress: bool = False,
) -> dict:
    """The figures of the module docstring for each of `dtypes` and for transformers float32."""
    import decodekit as dk
    from decodekit.engine import EngineConfig
    from decodekit.models.base import prefill

    # no preemption; the eager step throughout (an automatic compile would switch mid-run)
    config = EngineConfig(max_running=max(batches, default=1), max_kv_bytes=2**30, compile=False)

    first, hf = load_pair(model_name, "float32", device)
    models: dict[str, Any] = {}
    for dtype in dtypes:
        float32 = models.get("float32")
        models[dtype] = first if dtype == "float32" else _model(dtype, model_name, device, float32)
    eos = first.eos_token_ids[0] if first.eos_token_ids else 0
    [long_prompt] = prompts_from_text(first, 1, [prompt_tokens])
    short_prompt = first.encode("ROMEO:")
    greedy = dk.SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    shape = first.config  # NativeLM: the widest layer sets the GEMM peak
    peaks = {dtype: round(gemm_peak_gflops(shape.hidden_size, shape.intermediate_size, dtype), 1)
             for dtype in (torch.float32, torch.bfloat16)}  # fmt: skip
    results: dict = {"model": model_name, "parameters": first.num_parameters(), "device": device,
                     "gemm_peak_gflops": {str(d).removeprefix("torch."): v for d, v in peaks.items()},
                     "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
                     "batch_new_tokens": batch_new_tokens, "repeats": repeats,
                     "machine": machine()}  # fmt: skip
    bar = progress_bar(total=(2 + len(batches)) * (len(dtypes) + 1), desc="bench dtype", enabled=progress)

    def hf_prefill():
        with torch.inference_mode():
            hf(torch.tensor([long_prompt], device=hf.device), use_cache=True)

    rows: dict[str, dict] = {}
    for name, model in [*models.items(), ("hf_float32", None)]:
        row = rows[name] = {}
        if model is None:
            seconds = _median(hf_prefill, repeats, within_unit(bar))
        else:
            seconds = _median(lambda model=model: prefill(model, [long_prompt]), repeats, within_unit(bar))
        row["prefill"] = _rates(seconds, prompt_tokens)
        if model is None:
            seconds = _median(lambda: run_hf(hf, [short_prompt], new_tokens, False, pad=eos), repeats,
                              within_unit(bar))
        else:
            seconds = _median(lambda model=model: dk.generate(model, [short_prompt], greedy), repeats,
                              within_unit(bar))
        row["decode_batch1"] = _rates(seconds, new_tokens)
        for batch in batches:
            prompts = prompts_from_text(first, batch, CONCURRENT["prompt_lengths"])
            params = dk.SamplingParams(max_new_tokens=batch_new_tokens, seed=0, ignore_eos=True)
            step = within_unit(bar)
            if model is None:
                seconds = _median(lambda p=prompts: run_hf(hf, p, batch_new_tokens, True, pad=eos), repeats,
                                  step)
            else:
                seconds = _median(lambda m=model, p=prompts, s=params: run_engine(m, p, s, config), repeats,
                                  step)
            row[f"batch{batch}"] = _rates(seconds, batch * batch_new_tokens)
            processed = sum(len(p) for p in prompts) + batch * batch_new_tokens
            gflops = 2 * first.num_parameters() * processed / seconds["cpu_s"] / 1e9
            peak = peaks[torch.float32 if name in ("float32", "hf_float32") else torch.bfloat16]
            row[f"batch{batch}"] |= {"gflops": round(gflops, 1), "fraction_of_peak": round(gflops / peak, 3)}
    bar.close()
    results["results"] = rows
    base = rows.get("float32")
    if base is not None:
        results["ratio_to_float32_cpu_time"] = {
            name: {key: round(row[key]["cpu_tok_s"] / base[key]["cpu_tok_s"], 2) for key in row}
            for name, row in rows.items() if name != "float32"
        }  # fmt: skip
    return results
