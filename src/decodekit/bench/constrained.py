"""`decodekit bench constrained`: what a grammar mask costs (issue 5, REFERENCES.md).

For each constraint (a JSON schema, a regex, a Lark grammar) and strategy (greedy, sampling
at temperature 1): the constrained run's tokens/s, and the unconstrained run's tokens/s on
the same model, prompt and strategy for the same number of new tokens (EOS ignored). The
two runs alternate `repeats` times after a warm-up, and the slowdown is the median of the
paired time ratios, so that load on a shared machine hits both alike. Then the mask alone:
the constrained output is replayed through a fresh `GrammarMask`, timing per token llguidance's mask
(`compute`), the whole `apply` (mask, bit unpacking and -inf fill over the vocabulary) and
the matcher's advance (`accept`), plus the grammar's compile time. llguidance publishes
about 50 us per mask on large vocabularies (MaskBench, single thread).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from decodekit.bench.decode import machine
from decodekit.runtime import progress as progress_bar
from decodekit.runtime import within_unit

PROMPT = "ROMEO:\n"
CONSTRAINTS = {
    "json": {
        "type": "object",
        "properties": {
            "speaker": {"enum": ["ROMEO", "JULIET", "MERCUTIO", "NURSE"]},
            "act": {"type": "integer", "minimum": 1, "maximum": 5},
            "lines": {"type": "array", "items": {"type": "string", "maxLength": 60},
                      "minItems": 2, "maxItems": 4},
        },
        "required": ["speaker", "act", "lines"],
        "additionalProperties": False,
    },
    "regex": r"([A-Z][a-z]{1,9} ){8,16}[a-z]{1,9}\.",
    "grammar": 'start: line ("\\n" line){3}\nline: NAME ": " WORDS "."\nNAME: /[A-Z]{3,8}/\n'
    "WORDS: /[a-z]{1,8}( [a-z]{1,8}){3,9}/\n",
}


def make_constraint(kind: str, spec):
    from decodekit.decode.constrained import Grammar, JsonSchema, Regex

    return {"json": JsonSchema, "regex": Regex, "grammar": Grammar}[kind](spec)


def paired_seconds(first, second, repeats: int, on_progress: Callable[[float], None] | None = None,
                   ) -> tuple[list[float], list[float]]:
    """Seconds of `first()` and `second()`, alternated `repeats` times after one warm-up each;
    `on_progress`: the share of the rounds done, after each."""
    first(), second()
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(repeats):
        if on_progress is not None:
            on_progress((i + 1) / (repeats + 1))
        for fn, out in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    if on_progress is not None:
        on_progress(1.0)
    return times


def mask_timings(model, constraint, tokens: list[int]) -> dict:
    """Microseconds per token of the mask for a replay of `tokens`, and the compile time."""
    from decodekit.decode.constrained import GrammarMask

    start = time.perf_counter()
    mask = GrammarMask(model, constraint, 1)
    compile_ms = (time.perf_counter() - start) * 1e3
    logits = torch.zeros(1, model.vocab_size)
    compute, apply, accept = [], [], []
    words = torch.zeros(1, mask.words, dtype=torch.int32)
    for token in tokens:
        start = time.perf_counter()
        mask.matchers[0].unsafe_compute_mask_ptr(words[0].data_ptr(), mask.words * 4)
        compute.append(time.perf_counter() - start)
        start = time.perf_counter()
        mask.apply(logits)
        apply.append(time.perf_counter() - start)
        start = time.perf_counter()
        mask.accept(torch.tensor([token]))
        accept.append(time.perf_counter() - start)
    us = lambda xs: {"median": round(statistics.median(xs) * 1e6, 1),  # noqa: E731
                     "mean": round(statistics.fmean(xs) * 1e6, 1), "max": round(max(xs) * 1e6, 1)}
    return {"compile_ms": round(compile_ms, 2), "compute_us": us(compute), "apply_us": us(apply),
            "accept_us": us(accept)}


def bench_constrained(model_name: str = "shakespeare", repeats: int = 3, max_new_tokens: int = 200,
                      progress: bool = False) -> dict:
    """One row per constraint and strategy (module docstring); `progress`: a bar over them on stderr."""
    import decodekit as dk

    model = dk.load_model(model_name)
    results = {"model": model_name, "backend": type(model).__name__, "vocab_size": model.vocab_size,
               "prompt": PROMPT, "machine": machine(), "runs": []}
    bar = progress_bar(total=2 * len(CONSTRAINTS), desc="bench constrained", enabled=progress)
    for kind, spec in CONSTRAINTS.items():
        constraint = make_constraint(kind, spec)
        for mode, temperature in (("greedy", 0.0), ("sample", 1.0)):
            bar.set_postfix_str(f"{kind} {mode}")
            step = within_unit(bar)
            params = dk.SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=0)
            [c] = dk.generate(model, PROMPT, params, constraint=constraint)
            count = len(c.token_ids)
            plain = params.replace(max_new_tokens=count, ignore_eos=True)
            mask = mask_timings(model, constraint, c.token_ids)
            with_mask, without = paired_seconds(
                lambda p=params, c=constraint: dk.generate(model, PROMPT, p, constraint=c),
                lambda p=plain: dk.generate(model, PROMPT, p),
                repeats,
                step,
            )
            results["runs"].append({
                "constraint": kind, "strategy": mode, "new_tokens": count, "finish_reason": c.finish_reason,
                "constrained_tok_s": round(count / statistics.median(with_mask), 1),
                "unconstrained_tok_s": round(count / statistics.median(without), 1),
                "slowdown_pct": round(100 * (statistics.median(
                    a / b for a, b in zip(with_mask, without, strict=True)) - 1), 1),
                "mask": mask,
                # the mask's share of a step: (apply + accept) / unconstrained seconds per token
                "mask_share_pct": round(100 * (mask["apply_us"]["median"] + mask["accept_us"]["median"])
                                        * 1e-6 * count / statistics.median(without), 2),
                "text": c.text[:200],
            })
            step(1.0)
    bar.close()
    return results
