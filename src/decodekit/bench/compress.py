"""`decodekit bench compress`: perplexity, size and decode speed of compressed models.

For each configuration of GPTQ's and SparseGPT's tables (REFERENCES.md; per-channel
quantisation, 50 % unstructured and 2:4 sparsity): load the float model, compress it
(`compress_lm`, calibration on the shipped validation split), write a compressed directory
and load it back through `load_model`, as a user would. On the loaded model: held-out
per-token perplexity of the shipped test split (compress/evaluate.py defaults: windows of
the model's context, stride half of it), bytes of parameters and buffers in memory, bytes of
the weights file on disk, the mean KL(fp32 ‖ compressed) per position over the first
`kl_windows` context-length windows of the test split (compress/evaluate.py `mean_kl`), and
greedy decode tokens/s through `decodekit.generate` (batch 1,
EOS ignored, median of `repeats` runs after one warm-up, interleaved over the configurations,
one torch thread by default). The output head is tied to the embedding and stays float32 in
every row (as in GPTQ and SparseGPT, which leave embeddings and the head alone), so it bounds
how far memory can shrink.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from decodekit.bench.decode import machine
from decodekit.compress.recipe import CompressConfig
from decodekit.runtime import progress as progress_bar
from decodekit.runtime import within_unit

CONFIGS: tuple[CompressConfig | None, ...] = (
    None,  # the float32 model
    CompressConfig("rtn", bits=8),
    CompressConfig("rtn", bits=4),
    CompressConfig("gptq", bits=4),
    CompressConfig("rtn", bits=3),
    CompressConfig("gptq", bits=3),
    CompressConfig("magnitude", sparsity=0.5),
    CompressConfig("sparsegpt", sparsity=0.5),
    CompressConfig("magnitude", n_m="2:4"),
    CompressConfig("sparsegpt", n_m="2:4"),
)


def decode_tokens_per_second(
    models: list, new_tokens: int, repeats: int, prompt: str = "ROMEO:",
    on_progress: Callable[[float], None] | None = None,
) -> list[float]:
    """Greedy tokens/s of each model: one warm-up each, then `repeats` rounds over all models
    (interleaved, so load from other processes on a shared machine hits every model alike);
    the median round per model. `on_progress`: the share of the runs done, after each."""
    import decodekit as dk

    params = dk.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    runs, done = len(models) * (repeats + 1), 0
    for model in models:
        dk.generate(model, prompt, params)  # warm-up
        done += 1
        if on_progress is not None:
            on_progress(done / runs)
    times: list[list[float]] = [[] for _ in models]
    for _ in range(repeats):
        for i, model in enumerate(models):
            start = time.perf_counter()
            [completion] = dk.generate(model, prompt, params)
            times[i].append(time.perf_counter() - start)
            assert len(completion.token_ids) == new_tokens
            done += 1
            if on_progress is not None:
                on_progress(done / runs)
    return [new_tokens / statistics.median(t) for t in times]


def measure(
    model_name: str,
    config: CompressConfig | None,
    calib_windows: int | None = None,
    text: str | None = None,
    reference: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[dict, object]:
    """One row of the table but its speed (module docstring), and the loaded model; `text`
    replaces the held-out test split; `reference` is (tokens [W, T], the float model's
    log-probabilities [W, T, V]) for the KL column."""
    from dataclasses import replace

    from decodekit.compress.apply import model_nbytes
    from decodekit.compress.evaluate import mean_kl, text_perplexity
    from decodekit.compress.pretrained import WEIGHTS_FILE, save_compressed_dir
    from decodekit.compress.recipe import compress_lm
    from decodekit.models.registry import load_model, resolve

    _, source, _ = resolve(model_name)
    model = load_model(model_name, backend="native")
    row: dict = {"config": "fp32" if config is None else config.label(), "compress_s": 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "model"
        if config is not None:
            if calib_windows is not None and config.needs_calibration:
                config = replace(config, calib_windows=calib_windows)
            start = time.perf_counter()
            summary = compress_lm(model, config, None)
            row["compress_s"] = round(time.perf_counter() - start, 2)
            row["layers"] = len(summary.layers)
            row["calib_windows"] = summary.calib_batches
        save_compressed_dir(model, out, source)
        row["disk_bytes"] = (out / WEIGHTS_FILE).stat().st_size
        loaded = load_model(out)
    row["memory_bytes"] = model_nbytes(loaded.net)
    result = text_perplexity(loaded, text)
    row.update(perplexity=round(result.perplexity, 4), nll=round(result.nll, 5), tokens=result.tokens)
    if reference is not None:
        row["kl_fp32"] = float(f"{mean_kl(reference[1], loaded, reference[0]):.4g}")
    return row, loaded


def kl_reference(
    model_name: str, text: str | None, windows: int, length: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `windows` windows [W, T] of the text (T = min(length, context)) and the float
    model's log-probabilities [W, T, V] on them."""
    from decodekit.compress.evaluate import TEST_TEXT, window_logprobs
    from decodekit.models.registry import load_model

    model = load_model(model_name, backend="native")
    ids = torch.tensor(model.encode(TEST_TEXT.read_text() if text is None else text))
    length = min(length, model.max_context, len(ids))
    count = max(1, min(windows, len(ids) // length))
    tokens = ids[: count * length].view(count, length)  # [W, T]
    return tokens, window_logprobs(model, tokens)


def bench_compress(
    model_name: str = "shakespeare",
    new_tokens: int = 128,
    repeats: int = 3,
    calib_windows: int | None = None,
    configs: tuple[CompressConfig | None, ...] = CONFIGS,
    progress: bool = False,
    text: str | None = None,
    threads: int = 1,
    kl_windows: int = 16,
) -> dict:
    """Rows of `measure` for every configuration, decode speeds, and each row's change against
    fp32. `progress` shows a bar over the configurations and then the decode timings (one
    unit, moving with each run) on stderr. Runs on `threads` torch threads:
    on a shared 2-core machine two threads that wait on each other decode several times
    slower than one (measured: 42 vs 358 tok/s while other jobs ran)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        reference = kl_reference(model_name, text, kl_windows)
        rows, models = [], []
        with progress_bar(total=len(configs) + 1, desc="bench compress", enabled=progress) as bar:
            for config in configs:
                bar.set_postfix_str(config.label() if config is not None else "fp32")
                row, model = measure(model_name, config, calib_windows, text, reference)
                rows.append(row)
                models.append(model)
                bar.update()
            bar.set_postfix_str("decode speeds")
            speeds = decode_tokens_per_second(models, new_tokens, repeats, on_progress=within_unit(bar))
        report_machine = machine()
    finally:
        torch.set_num_threads(previous)
    for row, speed in zip(rows, speeds, strict=True):
        row["decode_tok_s"] = round(speed, 1)
    base = next((r for r in rows if r["config"] == "fp32"), None)
    if base is not None:
        for row in rows:
            row["ppl_change_pct"] = round(100 * (row["perplexity"] / base["perplexity"] - 1), 2)
            row["memory_ratio"] = round(row["memory_bytes"] / base["memory_bytes"], 3)
    return {"model": model_name, "new_tokens": new_tokens, "repeats": repeats,
            "machine": report_machine, "rows": rows}  # fmt: skip


def table(report: dict) -> str:
    """The report as a Markdown table."""
    lines = [
        f"{report['model']} (held-out Shakespeare test split, per-token perplexity)",
        "",
        "| config | perplexity | vs fp32 | KL from fp32 | memory MB | disk MB | decode tok/s "
        "| compress s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        change = f"{r['ppl_change_pct']:+.2f} %" if "ppl_change_pct" in r else ""
        kl = f"{r['kl_fp32']:.2g}" if "kl_fp32" in r else ""
        lines.append(
            f"| {r['config']} | {r['perplexity']:.2f} | {change} | {kl} | {r['memory_bytes'] / 1e6:.2f} | "
            f"{r['disk_bytes'] / 1e6:.2f} | {r['decode_tok_s']:.0f} | {r['compress_s']:.1f} |"
        )
    return "\n".join(lines)
