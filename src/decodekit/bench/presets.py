"""`decodekit bench presets`: what seed 003's use-case presets do to the shipped model's text.

Each preset (params.PRESETS: a temperature and a top-p) samples `samples` continuations of
`new_tokens` tokens (EOS ignored) for each of the held-out prompts of the contrastive
benchmark, beside plain sampling (T 1, top-p 1) and greedy decoding. The metrics are the
contrastive benchmark's (bench/contrastive.py): distinct-2/3 and the repeated-4-gram fraction
over token ids, and the log-likelihood per generated token under the expert (the model that
sampled, so it favours its own modes) and under a second model (`judge`, the draft model by
default) as a less partial reader.
"""

from __future__ import annotations

import statistics

from decodekit.bench.contrastive import distinct, held_out_prompts, loglik_per_token
from decodekit.bench.decode import machine
from decodekit.params import PRESETS
from decodekit.runtime import progress as progress_bar


def bench_presets(
    model_name: str = "shakespeare",
    judge_name: str = "shakespeare-draft",
    prompts: int = 20,
    samples: int = 4,
    new_tokens: int = 64,
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """Diversity and log-likelihood of every preset's samples, with plain sampling and greedy."""
    import decodekit as dk

    model, judge = dk.load_model(model_name), dk.load_model(judge_name)
    texts = held_out_prompts(prompts)
    prompt_ids = [model.encode(t) for t in texts]
    base = dk.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, seed=seed)
    configs = {"plain (T 1, top-p 1)": base.replace(n=samples), "greedy": base.replace(temperature=0.0)}
    configs |= {name: dk.SamplingParams.preset(name, max_new_tokens=new_tokens, ignore_eos=True, seed=seed,
                                               n=samples)
                for name in PRESETS}  # fmt: skip
    result = {"model": model_name, "judge": judge_name, "prompts": len(texts), "samples": samples,
              "new_tokens": new_tokens, "seed": seed, "machine": machine(), "rows": []}
    for name, params in progress_bar(configs.items(), total=len(configs), desc="bench presets",
                                     enabled=progress):
        completions = dk.generate(model, prompt_ids, params)
        rows = [(p, c.token_ids) for p, cs in zip(prompt_ids, completions, strict=True) for c in cs]
        prefixes, ids = [p for p, _ in rows], [x for _, x in rows]
        result["rows"].append({
            "config": name,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "distinct_2": round(statistics.fmean(distinct(x, 2) for x in ids), 4),
            "distinct_3": round(statistics.fmean(distinct(x, 3) for x in ids), 4),
            "repeated_4gram_fraction": round(statistics.fmean(1 - distinct(x, 4) for x in ids), 4),
            "expert_loglik_per_token": round(statistics.fmean(loglik_per_token(model, prefixes, ids)), 4),
            "judge_loglik_per_token": round(statistics.fmean(loglik_per_token(judge, prefixes, ids)), 4),
            "example": texts[0] + completions[0][0].text,
        })
    return result


def table(result: dict) -> str:
    """The rows as a Markdown table."""
    lines = ["| config | T | top-p | distinct-2 | distinct-3 | repeated 4-grams | expert loglik/token | "
             f"{result['judge']} loglik/token |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['config']} | {r['temperature']:g} | {r['top_p']:g} | {r['distinct_2']:.3f} | "
                     f"{r['distinct_3']:.3f} | {r['repeated_4gram_fraction']:.3f} | "
                     f"{r['expert_loglik_per_token']:.3f} | {r['judge_loglik_per_token']:.3f} |")
    return "\n".join(lines)
