"""The reward–KL frontier on the embedded Shakespeare model (`decodekit eval alignment`).

Reward: the keyword count of a 32-token completion (align/controlled.py `keyword_reward`);
completions have a fixed length (`ignore_eos`: the values train on [N, L] tokens, and EOS is
an ordinary token here) at temperature 1, every method drawn through `generate`.
Every method is a point (KL(pi || p) in nats, E_pi[reward]):
- best-of-n and soft best-of-n: exact plug-in values over the empirical distribution of the
  base samples (align/bon.py, align/soft_bon.py), with the bound log n - (n-1)/n beside them;
- the optimal tilt pi ∝ p exp(r/beta): self-normalised importance weights over base samples;
- token-wise CD (several lam) with a CD-Q and a CD-FUDGE value (`generate` with the
  `ValueTilt` adapter): reward of its samples, KL by Monte Carlo of the log-ratios
  sum_t log pi(z_t)/p(z_t) (and the sum of exact per-step KLs);
- blockwise CD (several K, M; `BlockwiseCD` over a `LocalGenerator`): reward of its samples,
  KL bound (L/M)(log K - (K-1)/K), and what it spent (its budget).
Seed 000 claims best-of-n lies close to the optimal frontier and that blockwise CD reaches
best-of-K's reward with a much smaller K (K = 6 against 50 in Mudgal et al. 2024).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from decodekit.align.blockwise import BlockwiseCD
from decodekit.align.bon import blockwise_kl_bound, bon_kl_bound, bon_kl_mc, bon_pmf
from decodekit.align.controlled import ValueTilt, keyword_reward, kl_terms, sample_base, score
from decodekit.align.soft_bon import soft_bon_pmf
from decodekit.align.tilt import tilt
from decodekit.align.value import PrefixValue, train_cdq, train_fudge
from decodekit.decode.sample import generate
from decodekit.meta.generator import LocalGenerator, derive_seed
from decodekit.optional import require
from decodekit.params import SamplingParams
from decodekit.runtime import progress as progress_bar

__all__ = ["FrontierConfig", "alignment_frontier", "plot_frontier", "table"]


@dataclass
class FrontierConfig:
    model: str = "shakespeare"
    prompt: str = "KING HENRY:\n"
    max_tokens: int = 32
    base_samples: int = 256  # train the values and estimate best-of-n / tilt from these
    samples: int = 64  # per controlled-decoding point
    bon_n: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    soft_n: int = 16
    soft_lams: tuple[float, ...] = (0.25, 0.5, 1.0)
    betas: tuple[float, ...] = (4.0, 2.0, 1.0, 0.7, 0.5, 0.35, 0.25)
    lams: tuple[float, ...] = (1.0, 2.0, 4.0)
    blocks: tuple[tuple[int, int], ...] = ((2, 8), (4, 8), (4, 4))
    train_top_k: int = 64  # children of p stored per position for CD-Q's target
    top_k: int | None = None  # token-wise CD candidates (None: all; top-k truncation alone costs KL)
    train_steps: int = 300
    seed: int = 0
    threads: int = 1  # tiny ops: one thread is ~10x faster than two on a shared 2-core machine


def _point(method: str, setting: str, kl: float, reward: float, **extra) -> dict:
    return {"method": method, "setting": setting, "kl": float(kl), "reward": float(reward), **extra}


def _sampled(method: str, setting: str, kl: float, rewards: torch.Tensor, **extra) -> dict:
    se = float(rewards.std() / math.sqrt(rewards.numel())) if rewards.numel() > 1 else 0.0
    return _point(method, setting, kl, float(rewards.mean()), reward_se=se, **extra)


def alignment_frontier(config: FrontierConfig | None = None, progress: bool = False) -> dict:
    """Run every method once; returns {"config", "points", "seconds"} (JSON-ready).
    `progress` shows a bar on stderr over the stages (base samples, two value trainings,
    each token-wise and blockwise run), the last stage's result beside it."""
    config = config or FrontierConfig()
    before = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return _frontier(config, progress)
    finally:
        torch.set_num_threads(before)


def _frontier(config: FrontierConfig, progress: bool) -> dict:
    stages = 3 + 2 * len(config.lams) + len(config.blocks)
    with progress_bar(total=stages, desc="eval alignment", enabled=progress) as bar:

        def say(line: str) -> None:
            bar.set_postfix_str(line, refresh=False)
            bar.update()

        return _run_frontier(config, say)


def _run_frontier(config: FrontierConfig, say: Callable[[str], None]) -> dict:
    from decodekit.models.registry import load_model

    start = time.perf_counter()
    torch.manual_seed(config.seed)  # the values' initial weights
    model = load_model(config.model)
    prompt = model.encode(config.prompt)
    reward = keyword_reward()
    length = config.max_tokens
    params = SamplingParams(max_new_tokens=length, ignore_eos=True)

    base = sample_base(model, prompt, params.replace(n=config.base_samples, seed=config.seed),
                       config.train_top_k)
    base.rewards = score(model, base.tokens, reward)
    r = base.rewards.numpy().astype(np.float64)
    uniform = np.full(r.size, 1.0 / r.size)
    say(f"base: {r.size} samples, mean reward {r.mean():.3f}")
    points = [_sampled("base", "p", 0.0, base.rewards)]
    for n in config.bon_n:
        pi = bon_pmf(uniform, r, n)
        points.append(_point("best-of-n", f"n={n}", bon_kl_mc(r, n), pi @ r,
                             kl_bound=bon_kl_bound(n)))
    for lam in config.soft_lams:
        pi = soft_bon_pmf(uniform, r, config.soft_n, lam)
        kl = float(np.sum(np.where(pi > 0, pi * np.log(np.maximum(pi, 1e-300) / uniform), 0.0)))
        points.append(_point("soft best-of-n", f"n={config.soft_n} lam={lam:g}", kl, pi @ r))
    for beta in config.betas:
        t = tilt(uniform, r, beta)
        points.append(_point("optimal tilt", f"beta={beta:g}", t.kl, t.expected_reward))

    values = {}
    for name, train in (("CD-Q", train_cdq), ("CD-FUDGE", train_fudge)):
        value = PrefixValue(model.vocab_size)
        losses = train(value, base, steps=config.train_steps)
        values[name] = value.eval()
        say(f"{name}: trained, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    for name, value in values.items():
        for lam in config.lams:
            steer = ValueTilt(value, lam, config.top_k)
            run = params.replace(n=config.samples, seed=derive_seed(config.seed, "token-wise", name, lam))
            [out] = generate(model, [prompt], run, adapter=steer)
            rewards = score(model, [c.token_ids for c in out], reward)
            log_ratio, step_kl = kl_terms(model, steer, prompt, out)
            kl = float(log_ratio.mean())
            se = float(log_ratio.std() / math.sqrt(log_ratio.numel()))
            points.append(_sampled(f"token-wise CD ({name})", f"lam={lam:g}", kl, rewards, kl_se=se,
                                   kl_steps=float(step_kl.mean())))
            say(f"token-wise {name} lam={lam:g}: reward {float(rewards.mean()):.3f}, KL {kl:.3f}")
    for k, m in config.blocks:
        cd = BlockwiseCD(LocalGenerator(model), values["CD-Q"].prefix_values, k, m)
        run = params.replace(seed=derive_seed(config.seed, "blockwise", k, m))
        [out] = cd.generate([prompt], config.samples, run)
        rewards = score(model, [c.token_ids for c in out], reward)
        bound = blockwise_kl_bound(math.ceil(length / m), k)
        points.append(_sampled("blockwise CD (CD-Q)", f"K={k} M={m}", bound, rewards,
                               kl_is_bound=True, budget=cd.budget.report()))
        say(f"blockwise K={k} M={m}: reward {float(rewards.mean()):.3f}, KL <= {bound:.3f}")
    return {"config": asdict(config), "points": points, "seconds": time.perf_counter() - start}


def table(report: dict) -> str:
    lines = [f"{'method':<26} {'setting':<16} {'KL (nats)':>14} {'reward':>14}"]
    for p in report["points"]:
        kl = f"{p['kl']:.3f}" + (f" ±{p['kl_se']:.2f}" if "kl_se" in p else "")
        kl = ("<= " if p.get("kl_is_bound") else "") + kl
        rew = f"{p['reward']:.3f}" + (f" ±{p['reward_se']:.2f}" if "reward_se" in p else "")
        lines.append(f"{p['method']:<26} {p['setting']:<16} {kl:>14} {rew:>14}")
    return "\n".join(lines)


def plot_frontier(report: dict, path) -> None:
    matplotlib = require("matplotlib", "eval", "plotting")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups: dict[str, list[dict]] = {}
    for p in report["points"]:
        groups.setdefault(p["method"], []).append(p)
    for method, pts in groups.items():
        kls, rewards = [p["kl"] for p in pts], [p["reward"] for p in pts]
        if method == "base":
            fmt = "k*"
        elif method.startswith("blockwise"):
            fmt = "s"
        elif method.startswith("token-wise"):
            fmt = "^"
        else:
            fmt = "-o"
        ax.plot(kls, rewards, fmt, ms=5, label=method)
    ax.set_xlabel("KL(pi || p) (nats; blockwise CD: bound)")
    ax.set_ylabel("expected keyword reward")
    ax.set_title(f"Reward–KL frontier, {report['config']['model']}, "
                 f"{report['config']['max_tokens']} tokens")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
