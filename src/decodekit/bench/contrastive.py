"""`decodekit bench contrastive`: greedy vs contrastive vs nucleus on held-out Shakespeare.

Seed 004 claims contrastive decoding cuts the repetition of greedy search. Prompts are the
opening lines (speaker and first line) of speeches of the shipped held-out test text;
each strategy continues every prompt by `new_tokens` tokens (EOS ignored, so lengths are
equal). Per generation, over token ids: distinct-n = unique n-grams / n-grams (n = 2, 3)
and the fraction of repeated 4-grams, 1 - distinct-4; averaged over prompts. Quality proxy:
the expert's log-likelihood per generated token (one expert forward over prompt +
continuation). Contrastive is Li et al.'s greedy search on CD scores (alpha = 0.1), also
with the amateur at temperature 0.5, with an 8-token amateur window, and as 4-beam search.
"""

from __future__ import annotations

import statistics
import time

import torch

from decodekit.bench.decode import machine
from decodekit.compress.evaluate import HELD_OUT
from decodekit.models.base import LanguageModel, score_batch
from decodekit.runtime import progress as progress_bar
from decodekit.runtime import within_unit


def held_out_prompts(count: int, text: str | None = None) -> list[str]:
    """The first two lines of `count` speeches spread evenly over the held-out text."""
    text = HELD_OUT["test"].read_text() if text is None else text
    speeches = [s for s in text.split("\n\n") if s.count("\n") >= 2 and s.split("\n")[0].endswith(":")]
    step = max(1, len(speeches) // count)
    return ["\n".join(s.split("\n")[:2]) + "\n" for s in speeches[::step][:count]]


def distinct(ids: list[int], n: int) -> float:
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


@torch.inference_mode()
def loglik_per_token(model: LanguageModel, prompts: list[list[int]], continuations: list[list[int]]):
    """Mean log p_model of each continuation's tokens given its prompt: one value per row."""
    rows = [p + c for p, c in zip(prompts, continuations, strict=True)]
    return [float(s.mean()) for s in score_batch(model, rows, [len(p) for p in prompts])]


def bench_contrastive(
    expert_name: str = "shakespeare",
    amateur_name: str = "shakespeare-draft",
    prompts: int = 20,
    new_tokens: int = 64,
    alpha: float = 0.1,
    amateur_temperature: float = 1.0,
    progress: bool = False,
) -> dict:
    """Diversity, expert log-likelihood and speed of each strategy; `progress`: a bar over them on stderr."""
    import decodekit as dk

    expert, amateur = dk.load_model(expert_name), dk.load_model(amateur_name)
    cd = dk.ContrastiveLM(expert, amateur, alpha=alpha, amateur_temperature=amateur_temperature)
    texts = held_out_prompts(prompts)
    prompt_ids = [expert.encode(t) for t in texts]
    base = dk.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    greedy = base.replace(temperature=0.0)
    strategies = {
        "greedy": (expert, greedy),
        "contrastive": (cd, greedy),
        "nucleus_p0.95": (expert, base.replace(top_p=0.95, seed=0)),
        "contrastive_amateur_t0.5": (dk.ContrastiveLM(expert, amateur, alpha, 0.5), greedy),
        "contrastive_window8": (dk.ContrastiveLM(expert, amateur, alpha, amateur_temperature, 8), greedy),
        "contrastive_beam4": (cd, base),
    }
    results = {"expert": expert_name, "amateur": amateur_name, "alpha": alpha,
               "amateur_temperature": amateur_temperature, "prompts": len(texts),
               "new_tokens": new_tokens, "machine": machine(), "strategies": {}}
    bar = progress_bar(total=len(strategies), desc="bench contrastive", enabled=progress)
    for name, (model, params) in strategies.items():
        bar.set_postfix_str(name)
        step = within_unit(bar)
        start = time.perf_counter()
        if name.endswith("beam4"):  # a search per prompt, the slowest strategy: shown prompt by prompt
            completions = []
            for p in prompt_ids:
                completions.append(dk.beam_search(model, [p], params, num_beams=4)[0][0])
                step(len(completions) / len(prompt_ids))
        else:
            completions = [cs[0] for cs in dk.generate(model, prompt_ids, params)]
        seconds = time.perf_counter() - start
        step(1.0)
        ids = [c.token_ids for c in completions]
        results["strategies"][name] = {
            "distinct_2": round(statistics.fmean(distinct(x, 2) for x in ids), 4),
            "distinct_3": round(statistics.fmean(distinct(x, 3) for x in ids), 4),
            "repeated_4gram_fraction": round(statistics.fmean(1 - distinct(x, 4) for x in ids), 4),
            "expert_loglik_per_token": round(statistics.fmean(loglik_per_token(expert, prompt_ids, ids)), 4),
            "tok_s": round(sum(map(len, ids)) / seconds, 1),
            "example": texts[0] + completions[0].text,
        }
    bar.close()
    return results
