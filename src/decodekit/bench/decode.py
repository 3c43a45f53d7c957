"""`decodekit bench decode`: tokens/s of `decodekit.generate` vs Hugging Face `generate()`.

Same weights, same run, batch 1, a fixed number of new tokens (EOS ignored so both
produce exactly that many), greedy and sampling at temperature 1. Each figure is
the median of `repeats` timed runs after one warm-up run; ratios are what to
compare across machines.
"""

from __future__ import annotations

import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import date

import torch

from decodekit.runtime import progress as progress_bar
from decodekit.runtime import within_unit


def _median_seconds(fn, repeats: int, on_progress: Callable[[float], None] | None = None) -> float:
    """Median seconds of `repeats` runs of fn() after one warm-up; `on_progress`: the share
    of the runs done, after each."""
    fn()  # warm-up
    times = []
    for i in range(repeats):
        if on_progress is not None:
            on_progress((i + 1) / (repeats + 1))
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    if on_progress is not None:
        on_progress(1.0)
    return statistics.median(times)


def machine() -> dict:
    from decodekit.models.dtype_probe import cpu_identity

    cpu = cpu_identity()  # /proc/cpuinfo's name, family and model; empty elsewhere
    model = f"{cpu['model name']} (family {cpu['cpu family']}, model {cpu['model']})"
    return {
        "date": date.today().isoformat(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": model if cpu["model name"] else "",
        "cpu_bf16_amx_flags": cpu["bf16_flags"],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


@contextmanager
def model_or_shape(model_name: str, shape: str | None = None) -> Iterator[str]:
    """`model_name`, or with `shape` the directory of a random-weight float32 checkpoint of
    that shape (models/shapes.py), written to a temporary directory for the run."""
    if shape is None:
        yield model_name
        return
    from decodekit.models.shapes import save_random_checkpoint

    with tempfile.TemporaryDirectory(prefix=f"decodekit-{shape}-") as folder:
        yield str(save_random_checkpoint(shape, folder))


def load_pair(model_name: str, dtype: str = "auto", device: str = "cpu", hf_dtype: str | None = None):
    """decodekit's `load_model` of `model_name` and the transformers model beside it, both in
    `dtype` (transformers' in `hf_dtype` when given) on `device`."""
    import decodekit as dk
    from decodekit.models.checkpoint import read_config
    from decodekit.models.hf import load_causal_lm
    from decodekit.models.registry import resolve, resolve_device, resolve_dtype

    model = dk.load_model(model_name, dtype=dtype, device=device)
    path = resolve(model_name)[1]
    torch_dtype = resolve_dtype(hf_dtype or dtype, read_config(path), resolve_device(device))
    return model, load_causal_lm(path, torch_dtype).to(resolve_device(device))


def hf_generation(new_tokens: int, sample: bool, pad_token_id: int, **fields):
    """transformers' GenerationConfig for exactly `new_tokens` tokens, greedy or plain sampling
    (temperature 1, no top-k or top-p), built clean rather than over the checkpoint's: the
    sampling fields only when sampling (on greedy, transformers warns that `top_k` "may be
    ignored"). `fields`: more GenerationConfig fields."""
    from transformers import GenerationConfig

    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {}
    return GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            pad_token_id=pad_token_id, **sampling, **fields)  # fmt: skip


def bench_decode(model_name: str = "shakespeare", new_tokens: int = 256, repeats: int = 3,
                 progress: bool = False, dtype: str = "auto", device: str = "cpu") -> dict:
    """decodekit and Hugging Face tok/s, greedy and sampling, in `dtype` on `device`;
    `progress`: a bar over the 4 timings."""
    import decodekit as dk

    model, hf = load_pair(model_name, dtype, device)
    prompt = "ROMEO:"
    ids = torch.tensor([model.encode(prompt)], device=hf.device)
    results = {"model": model_name, "backend": type(model).__name__, "new_tokens": new_tokens,
               "batch": 1, "dtype": str(hf.dtype).removeprefix("torch."), "machine": machine()}
    bar = progress_bar(total=4, desc="bench decode", enabled=progress)
    for mode, temperature in (("greedy", 0.0), ("sample", 1.0)):
        params = dk.SamplingParams(max_new_tokens=new_tokens, temperature=temperature,
                                   ignore_eos=True, seed=0)

        def ours(params=params):
            [c] = dk.generate(model, prompt, params)
            assert len(c.token_ids) == new_tokens

        def theirs(temperature=temperature):
            with torch.inference_mode():
                config = hf_generation(new_tokens, temperature > 0, model.eos_token_ids[0])
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            assert out.shape[1] - ids.shape[1] == new_tokens

        bar.set_postfix_str(f"decodekit {mode}")
        ours_s = _median_seconds(ours, repeats, within_unit(bar))
        bar.set_postfix_str(f"transformers {mode}")
        hf_s = _median_seconds(theirs, repeats, within_unit(bar))
        results[mode] = {
            "decodekit_tok_s": round(new_tokens / ours_s, 1),
            "hf_tok_s": round(new_tokens / hf_s, 1),
            "ratio": round(hf_s / ours_s, 3),
        }
    bar.close()
    return results
