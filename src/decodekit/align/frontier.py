"""The reward–KL frontier on the embedded Shakespeare model (`decodekit eval alignment`).

Reward (`FrontierConfig.reward`): "keywords", the keyword count of a 32-token completion
(align/controlled.py `keyword_reward`; sparse: most completions score 0), or "style", the
mean log-likelihood per token of the completion under the same model after another speaker's
name (`style_reward`, `style_prompt`; dense: every token adds to it). Completions have a
fixed length (`ignore_eos`: the values train on [N, L] tokens, and EOS is an ordinary token
here) at temperature 1, every method drawn through `generate`.
Value (`FrontierConfig.value`): "bag", the embedding-bag prefix value on token ids
(align/value.py `PrefixValue`), or "hidden", a Q head on the model's own last-layer states
(align/qvalue.py `QHead`, `HiddenValue`); each trained by CD-Q and by CD-FUDGE on the base
samples.
Every method is a point (KL(pi || p) in nats, E_pi[reward]):
- best-of-n and soft best-of-n: exact plug-in values over the empirical distribution of the
  base samples (align/bon.py, align/soft_bon.py), with the bound log n - (n-1)/n beside them;
- the optimal tilt pi ∝ p exp(r/beta): self-normalised importance weights over base samples;
- token-wise CD (several lam) with the CD-Q and the CD-FUDGE value (`generate` with the
  `ValueTilt` adapter): reward of its samples, KL by Monte Carlo of the log-ratios
  sum_t log pi(z_t)/p(z_t) (and the sum of exact per-step KLs);
- blockwise CD (several K, M; `BlockwiseCD` over a `LocalGenerator`) with each value: reward
  of its samples, KL bound (L/M)(log K - (K-1)/K), what it spent (its budget), and the n at
  which best-of-n's plug-in reward equals its reward (`bon_n_same_reward`, interpolated).
The two rewards spread alike over base samples (standard deviation 0.67 and 0.59 on the
Shakespeare model), so both use the same lam and beta settings.
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
from decodekit.align.controlled import (
    ValueTilt,
    generate_reporting,
    keyword_reward,
    kl_terms,
    sample_base,
    score,
    style_reward,
)
from decodekit.align.qvalue import HiddenValue, QHead, add_hidden_states, train_q_cdq, train_q_fudge
from decodekit.align.soft_bon import soft_bon_pmf
from decodekit.align.tilt import tilt
from decodekit.align.value import BaseSamples, PrefixValue, train_cdq, train_fudge
from decodekit.meta.generator import LocalGenerator, derive_seed
from decodekit.optional import require
from decodekit.params import SamplingParams
from decodekit.runtime import advance_to
from decodekit.runtime import progress as progress_bar
from decodekit.validate import check_n

__all__ = ["FrontierConfig", "alignment_frontier", "bon_n_same_reward", "plot_frontier", "table"]

VALUES = ("bag", "hidden")
REWARDS = ("keywords", "style")


@dataclass
class FrontierConfig:
    model: str = "shakespeare"
    prompt: str = "KING HENRY:\n"
    max_tokens: int = 32
    reward: str = "keywords"  # REWARDS
    style_prompt: str = "QUEEN MARGARET:\n"  # the style reward's speaker
    value: str = "bag"  # VALUES: embedding bag on token ids, or a Q head on hidden states
    base_samples: int = 256  # train the values and estimate best-of-n / tilt from these
    samples: int = 64  # per controlled-decoding point
    bon_n: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # those <= base_samples / 4
    soft_n: int = 16
    soft_lams: tuple[float, ...] = (0.25, 0.5, 1.0)
    betas: tuple[float, ...] = (4.0, 2.0, 1.0, 0.7, 0.5, 0.35, 0.25)
    lams: tuple[float, ...] = (1.0, 2.0, 4.0)
    blocks: tuple[tuple[int, int], ...] = ((2, 8), (4, 8), (2, 4), (4, 4), (6, 4), (8, 4))
    train_top_k: int = 64  # children of p stored per position for CD-Q's target
    top_k: int | None = None  # token-wise CD candidates (None: all; top-k truncation alone costs KL)
    train_steps: int = 300  # the embedding bag's full-batch Adam steps
    train_epochs: int = 4  # the Q head's epochs of minibatch Adam over the N·L pairs
    head_width: int = 64
    seed: int = 0
    threads: int = 1  # tiny ops: one thread is ~10x faster than two on a shared 2-core machine

    def __post_init__(self):
        if self.value not in VALUES:
            raise ValueError(f"value must be one of {', '.join(VALUES)}, got {self.value!r}")
        if self.reward not in REWARDS:
            raise ValueError(f"reward must be one of {', '.join(REWARDS)}, got {self.reward!r}")
        check_n(self.base_samples, "base_samples")
        check_n(self.samples, "samples")


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
    stages = 3 + 2 * len(config.lams) + 2 * len(config.blocks)
    with progress_bar(total=stages, desc="eval alignment", enabled=progress) as bar:
        return _run_frontier(config, _Stages(bar))


class _Stages:
    """The frontier's progress bar, one unit a stage (the base samples, each value's
    training, each token-wise and blockwise run): `within(share)` while a stage runs, so a
    stage of minutes moves the bar (issue 35: it read 0/21 for ten minutes), and `done(line)`
    at its end, the line beside the bar."""

    def __init__(self, bar):
        self.bar, self.finished = bar, 0

    def within(self, share: float) -> None:
        advance_to(self.bar, self.finished + min(share, 1.0))

    def part(self, start: float, end: float) -> Callable[[float], None]:
        """`within` for a part of the stage that runs from `start` to `end` of it."""
        return lambda share: self.within(start + (end - start) * share)

    def done(self, line: str) -> None:
        self.finished += 1
        self.bar.set_postfix_str(line, refresh=False)
        advance_to(self.bar, self.finished)


def _run_frontier(config: FrontierConfig, stages: _Stages) -> dict:
    from decodekit.models.registry import load_model

    start, cpu = time.perf_counter(), time.process_time()
    torch.manual_seed(config.seed)  # the values' initial weights
    model = load_model(config.model)
    prompt = model.encode(config.prompt)
    reward = keyword_reward() if config.reward == "keywords" else style_reward(model, config.style_prompt)
    length = config.max_tokens
    params = SamplingParams(max_new_tokens=length, ignore_eos=True)

    base = sample_base(model, prompt, params.replace(n=config.base_samples, seed=config.seed),
                       config.train_top_k, on_progress=stages.part(0.0, 0.9))
    base.rewards = score(model, base.tokens, reward)
    r = base.rewards.numpy().astype(np.float64)
    uniform = np.full(r.size, 1.0 / r.size)
    stages.done(f"base: {r.size} samples, mean reward {r.mean():.3f}")
    points = [_sampled("base", "p", 0.0, base.rewards)]
    for n in (n for n in config.bon_n if 4 * n <= r.size):  # the plug-in needs n << samples
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

    values = _train_values(config, model, prompt, base, stages)
    for name, value in values.items():
        for lam in config.lams:
            steer = ValueTilt(value, lam, config.top_k)
            run = params.replace(n=config.samples, seed=derive_seed(config.seed, "token-wise", name, lam))
            # the sampling, then the KL terms, a third of the stage (measured on the shipped model)
            out = generate_reporting(model, prompt, run, adapter=steer, on_progress=stages.part(0.0, 0.65))
            rewards = score(model, [c.token_ids for c in out], reward)
            log_ratio, step_kl = kl_terms(model, steer, prompt, out, on_progress=stages.part(0.7, 1.0))
            kl = float(log_ratio.mean())
            se = float(log_ratio.std() / math.sqrt(log_ratio.numel()))
            points.append(_sampled(f"token-wise CD ({name})", f"lam={lam:g}", kl, rewards,
                                   kl_se=se, kl_steps=float(step_kl.mean())))
            stages.done(f"token-wise {name} lam={lam:g}: reward {float(rewards.mean()):.3f}, KL {kl:.3f}")
    for name, value in values.items():
        for k, m in config.blocks:
            cd = BlockwiseCD(LocalGenerator(model), _counting(value.prefix_values, math.ceil(length / m),
                                                              stages.within), k, m)
            run = params.replace(seed=derive_seed(config.seed, "blockwise", k, m))
            [out] = cd.generate([prompt], config.samples, run)
            rewards = score(model, [c.token_ids for c in out], reward)
            bound = blockwise_kl_bound(math.ceil(length / m), k)
            point = _sampled(f"blockwise CD ({name})", f"K={k} M={m}", bound, rewards, kl_is_bound=True,
                             k=k, m=m, budget=cd.budget.report())
            same = bon_n_same_reward(r, point["reward"])
            point["bon_n_same_reward"] = same  # and at the reward -/+ one standard error:
            point["bon_n_range"] = [bon_n_same_reward(r, point["reward"] + d * point["reward_se"])
                                    for d in (-1, 1)]
            points.append(point)
            stages.done(f"blockwise {name} K={k} M={m}: reward {float(rewards.mean()):.3f} = best-of-{same}")
    return {"config": asdict(config), "points": points, "seconds": time.perf_counter() - start,
            "cpu_seconds": time.process_time() - cpu}


def _counting(value: Callable, calls: int, within: Callable[[float], None]) -> Callable:
    """`value`, calling `within` with the share of `calls` made: BlockwiseCD scores each
    block's candidates in one call, so this is its progress block by block."""
    made = 0

    def counted(candidates):
        nonlocal made
        out = value(candidates)
        made += 1
        within(made / calls)
        return out

    return counted


def _train_values(config: FrontierConfig, model, prompt: list[int], base: BaseSamples,
                  stages: _Stages) -> dict:
    """{"CD-Q": value, "CD-FUDGE": value} of the configured kind, trained on `base`."""
    values = {}
    if config.value == "hidden":
        add_hidden_states(model, prompt, base)
    for name, cdq in (("CD-Q", True), ("CD-FUDGE", False)):
        if config.value == "bag":
            value = PrefixValue(model.vocab_size)
            losses = (train_cdq if cdq else train_fudge)(value, base, steps=config.train_steps,
                                                         on_progress=stages.within)
            values[name] = value.eval()
        else:
            head = QHead(base.hidden.shape[-1], model.vocab_size, config.head_width,
                         baseline=float(base.rewards.mean()))
            train = train_q_cdq if cdq else train_q_fudge
            losses = train(head, base, epochs=config.train_epochs, seed=config.seed,
                           on_progress=stages.within)
            values[name] = HiddenValue(model, prompt, head)
        stages.done(f"{name}: trained, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return values


def bon_n_same_reward(rewards: np.ndarray, target: float, n_max: int = 4096) -> float | None:
    """The n at which best-of-n's plug-in expected reward over `rewards` reaches `target`,
    linear between integers (1.0 at or below the mean); None above best-of-`n_max` or of as
    many as there are rewards (the plug-in means little past that)."""
    r = np.asarray(rewards, dtype=np.float64)
    n_max = min(n_max, r.size)
    uniform = np.full(r.size, 1.0 / r.size)
    below = float(r.mean())
    if target <= below:
        return 1.0
    n = 1
    while n < n_max:  # doubling, then bisection: the reward grows with n
        upper = float(bon_pmf(uniform, r, 2 * n) @ r)
        if upper >= target:
            break
        n, below = 2 * n, upper
    else:
        return None
    lo, hi = n, 2 * n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        at = float(bon_pmf(uniform, r, mid) @ r)
        lo, hi, below, upper = (mid, hi, at, upper) if at < target else (lo, mid, below, at)
    return lo + (target - below) / (upper - below)


def table(report: dict) -> str:
    """One line per point; blockwise CD's with the best-of-n of the same reward (and of the
    reward -/+ one standard error) and n / K."""
    lines = [f"{'method':<26} {'setting':<16} {'KL (nats)':>14} {'reward':>14}  best-of-n same reward"]
    for p in report["points"]:
        kl = f"{p['kl']:.3f}" + (f" ±{p['kl_se']:.2f}" if "kl_se" in p else "")
        kl = ("<= " if p.get("kl_is_bound") else "") + kl
        rew = f"{p['reward']:.3f}" + (f" ±{p['reward_se']:.2f}" if "reward_se" in p else "")
        line = f"{p['method']:<26} {p['setting']:<16} {kl:>14} {rew:>14}"
        if "bon_n_same_reward" in p:
            same = p["bon_n_same_reward"]
            low, high = (f"{x:.1f}" if x is not None else "max" for x in p["bon_n_range"])
            line += ("  above the largest n" if same is None
                     else f"  n = {same:.1f} ({low}-{high}), n/K = {same / p['k']:.2f}")
        lines.append(line)
    return "\n".join(lines)


def plot_frontier(report: dict, path) -> None:
    """Left: reward against KL for every method. Right: reward against samples drawn per
    decision, best-of-n's n against blockwise CD's K (one line per value and M)."""
    matplotlib = require("matplotlib", "eval", "plotting")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config = report["config"]
    fig, (ax, ax_k) = plt.subplots(1, 2, figsize=(12, 4.5))
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
    ax.set_ylabel(f"expected {config.get('reward', 'keywords')} reward")
    ax.set_title(f"Reward–KL frontier, {config['model']}, {config['max_tokens']} tokens, "
                 f"{config.get('value', 'bag')} value")
    ax.legend(fontsize=7)
    bon = groups.get("best-of-n", [])
    ax_k.plot([int(p["setting"][2:]) for p in bon], [p["reward"] for p in bon], "k-o", ms=4,
              label="best-of-n (n)")
    for method, pts in groups.items():
        for m in sorted({p["m"] for p in pts if "m" in p}):
            row = sorted((p["k"], p["reward"]) for p in pts if p.get("m") == m)
            ax_k.plot(*zip(*row), "s--", ms=5, label=f"{method}, M={m} (K)")
    ax_k.set_xscale("log", base=2)
    ax_k.set_xlabel("samples per decision: n (best-of-n) or K (blockwise CD)")
    ax_k.set_ylabel("expected reward")
    ax_k.set_title("Blockwise CD's K against best-of-n's n")
    ax_k.legend(fontsize=7)
    for a in (ax, ax_k):
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
