"""`decodekit bench speculative`: speculative decoding on the embedded pair (issue 6).

Held-out prompts from the shipped Shakespeare test text, `new_tokens` new tokens each (EOS
ignored, so every run produces exactly that many), temperature 0 and 1, γ over 1..8:

- speedup: time of plain `decodekit.generate` on the same target and prompts divided by that
  of `speculative_generate`, wall clock and CPU; each configuration's time is its best of
  `repeats` runs, the plain reference the best of the runs interleaved with the sweep
  (other processes on a shared machine only ever add time);
- acceptance α (Leviathan et al.: mean Σ_x min(p, q) at the verified positions), the
  acceptance rate (accepted / drafted) and block efficiency (tokens per target call) of
  block and token verification; at temperature 1 also a paired comparison: E[τ] of both
  rules on the same blocks (`expected_accepted`), which removes most sampling noise;
- Hugging Face assisted generation (`generate(assistant_model=...)`) on the same pair, at
  its defaults and at the γ we found best, with HF plain `generate()` for reference;
- prompt lookup (ours and HF's `prompt_lookup_num_tokens`) on a prompt-copying workload:
  a passage followed by its first line again, so continuing means copying.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from decodekit.bench.decode import machine
from decodekit.compress.evaluate import HELD_OUT
from decodekit.decode.speculative import speculative_generate
from decodekit.decode.verification import block_verify, expected_accepted
from decodekit.params import SamplingParams
from decodekit.runtime import progress as progress_bar


def heldout_prompts(model, count: int, max_tokens: int = 48) -> list[str]:
    """`count` speeches spread evenly over the test text, each cut to about `max_tokens` tokens."""
    speeches = [s.strip() for s in HELD_OUT["test"].read_text().split("\n\n") if len(s.strip()) > 200]
    chosen = [speeches[i * len(speeches) // count] for i in range(count)]
    return [model.decode(model.encode(s)[:max_tokens]) for s in chosen]


def copy_prompts(model, count: int, passage_tokens: int = 160) -> list[str]:
    """A passage, a blank line, and the passage's first line again: the likely continuation
    repeats the passage, which prompt lookup can draft."""
    speeches = [s.strip() for s in HELD_OUT["test"].read_text().split("\n\n") if len(s.strip()) > 600]
    prompts = []
    for i in range(count):
        passage = model.decode(model.encode(speeches[(2 * i + 1) * len(speeches) // (2 * count)])
                               [:passage_tokens])  # fmt: skip
        prompts.append(passage + "\n\n" + passage.split("\n")[0] + "\n")
    return prompts


@dataclass
class Timing:
    """Wall-clock and CPU (process) seconds of one run. On a shared machine the CPU time is
    the steadier measure of the work done; with one thread it is close to an idle wall time."""

    wall: float
    cpu: float


def timed(fn, repeats: int = 1) -> Timing:
    """The best (smallest) wall and CPU time of `repeats` runs, as `timeit` reports: other
    processes on a shared machine only ever add time."""
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return Timing(min(walls), min(cpus))


def bench_params(new_tokens: int, temperature: float) -> SamplingParams:
    """A benchmark request: `new_tokens` tokens whatever EOS, seed 0 (the drivers in
    benchmarks/ use it too)."""
    return SamplingParams(max_new_tokens=new_tokens, temperature=temperature, ignore_eos=True, seed=0)


def run_plain(model, prompts, params, repeats: int = 1) -> Timing:
    import decodekit as dk

    def go():
        for prompt in prompts:
            [c] = dk.generate(model, prompt, params)
            assert len(c.token_ids) == params.max_new_tokens

    return timed(go, repeats)


def run_speculative(
    target, draft, prompts, params, gamma, verify, adaptive=False, repeats: int = 1, fallback: bool = False
) -> tuple[dict, Timing]:
    """Stats summed over the prompts (seeded: every repeat is the same), and the best timing.
    Without the per-row fallback by default: the sweep measures speculation at every step."""
    total: dict = {}

    def go():
        total.clear()
        for prompt in prompts:
            result = speculative_generate(target, draft, prompt, params, gamma, verify, adaptive,
                                          fallback=fallback)  # fmt: skip
            assert len(result.completions[0].token_ids) == params.max_new_tokens
            for key, value in vars(result.stats).items():
                total[key] = total.get(key, 0) + value

    return total, timed(go, repeats)


def summary(stats: dict, timing: Timing, plain: Timing, beside: tuple[Timing, Timing] | None = None) -> dict:
    """A configuration's figures against `plain` (the sweep's best plain run); with `beside`,
    the plain runs just before and after it, also `speedup_cpu_beside`: against their mean CPU
    time, the load it shared (on a shared machine the best plain run may come from a quieter
    minute)."""
    drafted, blocks = stats["drafted_tokens"], stats["target_calls"]
    extra = {} if beside is None else {"speedup_cpu_beside": round((beside[0].cpu + beside[1].cpu) / 2
                                                                   / timing.cpu, 3)}
    return {
        "alpha": round(stats["alpha_sum"] / max(stats["alpha_count"], 1), 3),
        "acceptance_rate": round(stats["accepted_tokens"] / max(drafted, 1), 3),
        "block_efficiency": round(stats["emitted_tokens"] / blocks, 3),
        "target_calls": blocks,
        "draft_calls": stats["draft_calls"],
        "seconds": round(timing.wall, 3),
        "draft_share": round(stats["draft_seconds"] / stats["wall_seconds"], 3),
        "tok_s": round(stats["emitted_tokens"] / timing.wall, 1),
        "cpu_tok_s": round(stats["emitted_tokens"] / timing.cpu, 1),
        "speedup": round(plain.wall / timing.wall, 3),
        "speedup_cpu": round(plain.cpu / timing.cpu, 3),
        **extra,
    }


def paired_block_efficiency(target, draft, prompts, params, gamma) -> dict:
    """E[τ] + 1 per block of both rules, on the same blocks (those block verification visits)."""
    sums = {"token": 0.0, "block": 0.0, "blocks": 0}

    def recording_block_verify(p, q, x, generator):
        if len(x):
            for rule in ("token", "block"):
                sums[rule] += expected_accepted(rule, p, q, x)
            sums["blocks"] += 1
        return block_verify(p, q, x, generator)

    for prompt in prompts:
        speculative_generate(target, draft, prompt, params, gamma, recording_block_verify, fallback=False)
    token = 1 + sums["token"] / sums["blocks"]
    block = 1 + sums["block"] / sums["blocks"]
    return {"token": round(token, 4), "block": round(block, 4), "gain": round(block / token - 1, 4)}


def hf_runs(target_name, draft_name, prompts, new_tokens, temperature, gamma, repeats=1) -> dict:
    """tokens/s of HF plain generate(), assisted generation at HF's defaults, and at γ."""
    from decodekit.bench.decode import hf_generation
    from decodekit.models.checkpoint import load_tokenizer
    from decodekit.models.hf import load_causal_lm
    from decodekit.models.registry import resolve

    def load(name):
        path = resolve(name)[1]
        return load_causal_lm(path, torch.float32), path

    target, path = load(target_name)
    assistant, _ = load(draft_name)
    tokenizer = load_tokenizer(path)
    generation = hf_generation(new_tokens, temperature > 0, tokenizer.eos_token_id)
    defaults = assistant.generation_config
    settings = {"plain": None, "assisted_default": {},
                f"assisted_gamma{gamma}": {"num_assistant_tokens": gamma,
                                           "num_assistant_tokens_schedule": "constant",
                                           "assistant_confidence_threshold": 0.0}}  # fmt: skip
    out = {}
    for label, config in settings.items():
        if config is not None:
            for key, value in config.items():
                setattr(defaults, key, value)

        def go(config=config):
            for prompt in prompts:
                ids = torch.tensor([tokenizer.encode(prompt)])
                extra = {} if config is None else {"assistant_model": assistant}
                with torch.inference_mode():
                    result = target.generate(ids, attention_mask=torch.ones_like(ids),
                                             generation_config=generation, **extra)  # fmt: skip
                assert result.shape[1] - ids.shape[1] == new_tokens

        go()  # warm-up
        out[label] = tokens_per_second(new_tokens * len(prompts), timed(go, repeats))
    return out


def tokens_per_second(tokens: int, timing: Timing) -> dict:
    return {"tok_s": round(tokens / timing.wall, 1), "cpu_tok_s": round(tokens / timing.cpu, 1)}


def hf_prompt_lookup(target_name, prompts, new_tokens, gamma, repeats=1) -> dict:
    from decodekit.bench.decode import hf_generation
    from decodekit.models.checkpoint import load_tokenizer
    from decodekit.models.hf import load_causal_lm
    from decodekit.models.registry import resolve

    path = resolve(target_name)[1]
    target = load_causal_lm(path, torch.float32)
    tokenizer = load_tokenizer(path)
    generation = hf_generation(new_tokens, False, tokenizer.eos_token_id, prompt_lookup_num_tokens=gamma)

    def go():
        for prompt in prompts:
            ids = torch.tensor([tokenizer.encode(prompt)])
            with torch.inference_mode():
                target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=generation)

    go()
    return tokens_per_second(new_tokens * len(prompts), timed(go, repeats))


def kgram_drafter(target, order: int = 4):
    """A token-level Kneser-Ney k-gram over the validation text (not the benchmark's test text)."""
    from decodekit.models.ngram import NGramConfig, train_ngram

    texts = [t for t in HELD_OUT["val"].read_text().split("\n\n") if t.strip()]
    return train_ngram(texts, NGramConfig(order), level="token", tokenizer=target.tokenizer,
                       name=f"val-{order}gram")


def bench_speculative(
    target_name: str = "shakespeare",
    draft_name: str = "shakespeare-draft",
    new_tokens: int = 256,
    gammas: tuple[int, ...] = tuple(range(1, 9)),
    num_prompts: int = 3,
    quick: bool = False,
    hf: bool = True,
    threads: int = 1,
    repeats: int = 3,
    progress: bool = False,
) -> dict:
    """The whole benchmark as a dict (see the module doc). `threads`: torch intra-op threads for
    every run, ours and HF's; one is fastest for models this small and steadiest on a shared
    machine, where a second thread mostly waits for a core. `progress`: a bar over the
    configurations on stderr."""
    if quick:
        new_tokens, gammas, num_prompts, repeats = min(new_tokens, 64), (2, 4), 1, 1
    # configurations: the sweep at t=0 (one rule) and t=1 (two), paired, copy workload, HF
    total = 3 * len(gammas) + 2 * 5 + 1 + 4 + (3 if hf else 0)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with progress_bar(total=total, desc="bench speculative", enabled=progress) as bar:
            return _bench(target_name, draft_name, new_tokens, gammas, num_prompts, hf, repeats, bar)
    finally:
        torch.set_num_threads(previous)


def _bench(target_name, draft_name, new_tokens, gammas, num_prompts, hf, repeats, bar) -> dict:
    import decodekit as dk

    target, draft = dk.load_model(target_name), dk.load_model(draft_name)
    prompts = heldout_prompts(target, num_prompts)
    out: dict = {"target": target_name, "draft": draft_name, "backend": type(target).__name__,
                 "new_tokens": new_tokens, "prompts": len(prompts), "machine": machine(),
                 "load_average": [os.getloadavg()[0]],
                 "target_parameters": target.num_parameters(),
                 "draft_parameters": draft.num_parameters(), "rows": []}  # fmt: skip
    kgram = kgram_drafter(target)
    run_speculative(target, draft, prompts[:1], bench_params(16, 1.0), 2, "block")  # warm-up
    run_plain(target, prompts[:1], bench_params(16, 1.0))
    for temperature in (0.0, 1.0):
        params = bench_params(new_tokens, temperature)
        sweep = []
        rules = ("block",) if temperature == 0 else ("token", "block")  # greedy: the same rule
        for gamma in gammas:
            sweep += [("draft model", gamma, verify, False, draft) for verify in rules]
        sweep.append(("draft model", 4, "block", True, draft))
        sweep += [("k-gram", g, "block", False, kgram) for g in (2, 4)]
        sweep += [("prompt lookup", g, "block", False, "prompt-lookup") for g in (2, 4)]
        plains, runs = [], []
        for task, gamma, verify, adaptive, drafter in sweep:
            bar.set_postfix_str(f"t={temperature:g} {task} gamma={gamma} {verify}", refresh=False)
            # The plain baseline runs once between configurations; its best time over the
            # whole sweep is the reference, as each configuration's is its best of `repeats`.
            plains.append(run_plain(target, prompts, params))
            stats, timing = run_speculative(target, drafter, prompts, params, gamma, verify, adaptive,
                                            repeats)  # fmt: skip
            runs.append((task, gamma, verify, adaptive, stats, timing))
            bar.update()
        plains.append(run_plain(target, prompts, params))  # after the last configuration
        plain = Timing(min(t.wall for t in plains), min(t.cpu for t in plains))
        for i, (task, gamma, verify, adaptive, stats, timing) in enumerate(runs):
            row = {"task": task, "temperature": temperature, "gamma": gamma, "verify": verify,
                   "adaptive": adaptive,
                   **summary(stats, timing, plain, beside=(plains[i], plains[i + 1]))}  # fmt: skip
            out["rows"].append(row)
        out[f"plain_t{temperature:g}"] = tokens_per_second(new_tokens * len(prompts), plain)
    out["paired_t1"] = {g: paired_block_efficiency(target, draft, prompts, bench_params(new_tokens, 1.0), g)
                        for g in gammas}  # fmt: skip
    bar.update()
    copies = copy_prompts(target, num_prompts)
    params = bench_params(new_tokens, 0.0)
    out["copy_workload"] = {}
    for gamma in (4, 8):
        for label, drafter in (("prompt lookup", "prompt-lookup"), ("draft model", draft)):
            plain = run_plain(target, copies, params, repeats)
            stats, timing = run_speculative(target, drafter, copies, params, gamma, "block", False,
                                            repeats)  # fmt: skip
            out["copy_workload"][f"{label} gamma{gamma}"] = summary(stats, timing, plain)
            bar.update()
    if hf:
        model_rows = [r for r in out["rows"] if r["task"] == "draft model" and not r["adaptive"]]
        for temperature in (0.0, 1.0):
            rows = [r for r in model_rows if r["temperature"] == temperature]
            best = max(rows, key=lambda r: r["speedup_cpu_beside"])
            runs = hf_runs(target_name, draft_name, prompts, new_tokens, temperature, best["gamma"],
                           repeats)  # fmt: skip
            params = bench_params(new_tokens, temperature)
            plain = run_plain(target, prompts, params, repeats)
            stats, timing = run_speculative(target, draft, prompts, params, best["gamma"], best["verify"],
                                            False, repeats)  # fmt: skip
            runs["decodekit_plain"] = tokens_per_second(new_tokens * len(prompts), plain)
            runs[f"decodekit_gamma{best['gamma']}_{best['verify']}"] = tokens_per_second(
                new_tokens * len(prompts), timing)
            out[f"hf_t{temperature:g}"] = runs
            bar.update()
        params = bench_params(new_tokens, 0.0)
        out["copy_workload"]["hf_prompt_lookup_gamma8"] = hf_prompt_lookup(
            target_name, copies, new_tokens, 8, repeats)
        _, timing = run_speculative(target, "prompt-lookup", copies, params, 8, "block", False, repeats)
        out["copy_workload"]["decodekit_prompt_lookup_gamma8"] = tokens_per_second(
            new_tokens * len(copies), timing)
        bar.update()
    out["load_average"].append(os.getloadavg()[0])
    return out


def markdown_table(result: dict) -> str:
    """Seed 000's table shape: task, temperature, γ, α, speedup (plus our extra columns)."""
    lines = ["| task | temp | γ | verify | α | accept rate | block eff. | tok/s | "
             "speedup (CPU, beside plain) | speedup (CPU, best plain) |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["rows"]:
        gamma = f"{r['gamma']}{' (adaptive)' if r['adaptive'] else ''}"
        lines.append(f"| {r['task']} | {r['temperature']:g} | {gamma} | {r['verify']} | "
                     f"{r['alpha']:.2f} | {r['acceptance_rate']:.2f} | {r['block_efficiency']:.2f} | "
                     f"{r['tok_s']:.0f} | {r['speedup_cpu_beside']:.2f}× | "
                     f"{r['speedup_cpu']:.2f}× |")  # fmt: skip
    return "\n".join(lines)


# -- concurrent requests on the engine (issue 14) ---------------------------------------------


def bench_concurrent(
    target_name: str = "shakespeare",
    draft_name: str = "shakespeare-draft",
    concurrent: int = 16,
    new_tokens: int = 64,
    gamma: int = 4,
    repeats: int = 3,
    single_prompts: int = 3,
    threads: int = 1,
    prompt_tokens: int | None = None,
) -> dict:
    """`concurrent` speculative requests (distinct held-out prompts, T = 0, EOS ignored) batched
    on the target's persistent engine against the same requests decoded plainly on that
    engine: tokens/s, wall and CPU, each the best of `repeats` interleaved runs. The
    speculative configurations run with the per-row fallback (speculation_gate.py, the
    default) and without it (`_always`: every row speculates at every step). Then the same
    with prompt lookup on prompts that repeat their text (`copy_prompts`), and the
    single-request speedup (each of `single_prompts` prompts alone, one after another), as
    `bench_speculative` measures it. Greedy speculative output must equal plain greedy output
    token for token, which is checked.

    prompt_tokens: instead, prompts of exactly that many tokens (`long_context.py`: windows of
    the validation text), on an engine whose pools keep every prompt's KV, the target's and
    the draft's, between runs (the timed runs decode; the untimed reference run prefills);
    no copy workload. Issue 36: seed 001's claim that speculation pays at long context."""
    import decodekit as dk
    from decodekit.bench import long_context
    from decodekit.engine.engine import engine_for

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        target, draft = dk.load_model(target_name), dk.load_model(draft_name)
        params = bench_params(new_tokens, 0.0)
        if prompt_tokens is None:
            workloads = {"heldout": heldout_prompts(target, concurrent),
                         "copy": copy_prompts(target, concurrent)}  # fmt: skip
        else:
            long_context.check_context((target, draft), prompt_tokens, new_tokens, gamma)
            workloads = {"heldout": long_context.context_prompts(target, concurrent, prompt_tokens)}
            engine_for(target, long_context.context_engine_config(concurrent, prompt_tokens + new_tokens
                                                                  + gamma))  # fmt: skip
        expected = {name: [c[0].token_ids for c in dk.generate(target, prompts, params)]  # and warm-up
                    for name, prompts in workloads.items()}  # fmt: skip
        # key: (workload, drafter, γ, adaptive, fallback)
        lookup = "prompt-lookup"
        configs = {f"gamma{gamma}": ("heldout", draft, gamma, False, True),
                   f"gamma{gamma}_always": ("heldout", draft, gamma, False, False),
                   f"gamma{gamma}_adaptive": ("heldout", draft, gamma, True, True),
                   "gamma1_always": ("heldout", draft, 1, False, False),
                   f"copy_lookup_gamma{gamma}": ("copy", lookup, gamma, False, True),
                   f"copy_lookup_gamma{gamma}_always": ("copy", lookup, gamma, False, False)}  # fmt: skip
        singles = {f"single_gamma{gamma}": ("heldout", draft, gamma, False, True),
                   f"single_gamma{gamma}_always": ("heldout", draft, gamma, False, False),
                   f"single_copy_lookup_gamma{gamma}": ("copy", lookup, gamma, False, True)}  # fmt: skip
        configs = {key: config for key, config in configs.items() if config[0] in workloads}
        singles = {key: config for key, config in singles.items() if config[0] in workloads}
        results: dict = {}

        def spec_run(batches, key, workload, drafter, g, adaptive, fallback):
            def go():
                for batch in batches:  # each batch: the prompts of one call, by index
                    prompts = [workloads[workload][i] for i in batch]
                    result = speculative_generate(target, drafter, prompts, params, g, "block", adaptive,
                                                  fallback=fallback)  # fmt: skip
                    tokens = [c[0].token_ids for c in result.completions]
                    want = [expected[workload][i] for i in batch]
                    assert tokens == want, "speculative greedy != plain greedy"
                    results[key] = result.stats

            return go

        def plain_run(batches, workload):
            prompts = workloads[workload]
            return lambda: [dk.generate(target, [prompts[i] for i in batch], params) for batch in batches]

        everything, one_by_one = [list(range(concurrent))], [[i] for i in range(single_prompts)]
        runs: dict[str, list[Timing]] = {}
        engine, steps = engine_for(target), {}

        def counted(key, fn):  # the engine steps a run took (the same in every repeat)
            def go():
                before = engine.steps
                fn()
                steps[key] = engine.steps - before

            return go

        cached_before = engine.stats()["prefix_cache_hit_tokens"]
        for _ in range(repeats):  # interleaved, so load from other processes hits all alike
            for workload in workloads:
                key = "plain" if workload == "heldout" else "copy_plain"
                runs.setdefault(key, []).append(timed(counted(key, plain_run(everything, workload))))
            for key, config in configs.items():
                runs.setdefault(key, []).append(timed(counted(key, spec_run(everything, key, *config))))
            for workload in workloads:
                key = "single_plain" if workload == "heldout" else "single_copy_plain"
                runs.setdefault(key, []).append(timed(plain_run(one_by_one, workload)))
            for key, config in singles.items():
                runs.setdefault(key, []).append(timed(spec_run(one_by_one, key, *config)))
        best = {key: Timing(min(t.wall for t in ts), min(t.cpu for t in ts)) for key, ts in runs.items()}

        def per_step(key):
            cpu_ms = round(1000 * best[key].cpu / steps[key], 2)
            return {"engine_steps": steps[key], "cpu_ms_per_step": cpu_ms}

        def against(key, plain, tokens):
            stats = results[key]
            return {**tokens_per_second(tokens, best[key]),
                    "speedup": round(best[plain].wall / best[key].wall, 3),
                    "speedup_cpu": round(best[plain].cpu / best[key].cpu, 3),
                    "acceptance_rate": round(stats.acceptance_rate, 3),
                    "block_efficiency": round(stats.block_efficiency, 3),
                    "plain_steps": stats.plain_steps,
                    "draft_share": round(stats.draft_seconds / stats.wall_seconds, 3)}  # fmt: skip

        total = concurrent * new_tokens
        out: dict = {"target": target_name, "draft": draft_name, "concurrent": concurrent,
                     "new_tokens": new_tokens, "temperature": 0, "verify": "block",
                     "machine": machine(), "load_average": os.getloadavg()[0],
                     "prompt_tokens": prompt_tokens,
                     # prompt tokens the timed runs took from the target's prefix cache, not prefilled
                     "prefix_cache_hit_tokens": engine.stats()["prefix_cache_hit_tokens"] - cached_before,
                     "plain": {**tokens_per_second(total, best["plain"]), **per_step("plain")}}  # fmt: skip
        if "copy" in workloads:
            out["copy_plain"] = {**tokens_per_second(total, best["copy_plain"]), **per_step("copy_plain")}
        for key, config in configs.items():
            plain = "plain" if config[0] == "heldout" else "copy_plain"
            out[key] = {**against(key, plain, total), **per_step(key)}
        single_total = single_prompts * new_tokens
        out["single"] = {"prompts": single_prompts, "gamma": gamma,
                         "plain": tokens_per_second(single_total, best["single_plain"])}  # fmt: skip
        if "copy" in workloads:
            out["single"]["copy_plain"] = tokens_per_second(single_total, best["single_copy_plain"])
        for key, config in singles.items():
            plain = "single_plain" if config[0] == "heldout" else "single_copy_plain"
            out["single"][key.removeprefix("single_")] = against(key, plain, single_total)
        return out
    finally:
        torch.set_num_threads(previous)
