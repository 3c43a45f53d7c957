"""The best-of-n calculator behind `decodekit align bon`: numbers as a dict, and a plot.

`bon_report(p, r, n)` gathers, for a discrete base distribution p with rewards r:

- kl: the exact KL(pi_n || p);  kl_bound: log n - (n-1)/n, the "popular formula";
- kl_estimate: seed 000's estimator D^(eps) averaged over the selected outcome,
  E_{y~pi_n} D^(p(y)) -- what the estimator returns on average when run on best-of-n
  samples; kl_estimate_at_mode: D^(p(y*)) for the most likely selected outcome y*;
- kl_max: -log p(top reward level), the KL of best-of-infinity;
- win_rate: exact, ties counting 1/2;  win_rate_bound: n/(n+1);
- pmf: the best-of-n distribution; and with `curve=True` the same numbers for 1..n.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from decodekit.align.bon import (
    bon_kl,
    bon_kl_bound,
    bon_kl_estimate,
    bon_kl_max,
    bon_pmf,
    bon_win_rate,
    bon_win_rate_bound,
)
from decodekit.align.pmf import check_pmf, check_rewards
from decodekit.optional import require
from decodekit.validate import check_n

__all__ = ["bon_report", "plot_bon"]


def _row(p: np.ndarray, r: np.ndarray, n: int) -> dict:
    pmf = bon_pmf(p, r, n)
    support = pmf > 0
    estimates = bon_kl_estimate(p[support], n)  # D^(p(y)) for each outcome it can select
    mode = int(np.argmax(pmf))
    return {
        "n": n,
        "kl": bon_kl(p, r, n),
        "kl_bound": bon_kl_bound(n),
        "kl_estimate": float(pmf[support] @ estimates),
        "kl_estimate_at_mode": float(bon_kl_estimate(p[mode], n)),
        "win_rate": bon_win_rate(p, r, n),
        "win_rate_bound": bon_win_rate_bound(n),
        "pmf": pmf.tolist(),
    }


def bon_report(p, r, n: int, curve: bool = False) -> dict:
    """The best-of-n numbers for n (and, with curve=True, for every m in 1..n)."""
    p = check_pmf(p)
    r = check_rewards(r, p.size)
    n = check_n(n)
    report = {"p": p.tolist(), "r": r.tolist(), "kl_max": bon_kl_max(p, r), **_row(p, r, n)}
    if curve:
        report["curve"] = [_row(p, r, m) for m in range(1, n + 1)]
    return report


def plot_bon(p, r, n_max: int, path: str | Path) -> Path:
    """Plot KL (exact, bound, estimate) and win rate (exact, bound) against n = 1..n_max."""
    # Lazy: matplotlib is an optional dependency (extra "eval"). A bare Figure needs no
    # pyplot and no global backend switch.
    Figure = require("matplotlib.figure", "eval", "plotting").Figure

    rows = bon_report(p, r, n_max, curve=True)["curve"]
    ns = [row["n"] for row in rows]
    fig = Figure(figsize=(10, 4))
    ax_kl, ax_win = fig.subplots(1, 2)
    ax_kl.plot(ns, [row["kl"] for row in rows], "o-", ms=3, label="exact KL")
    ax_kl.plot(ns, [row["kl_bound"] for row in rows], "--", label="log n - (n-1)/n (bound)")
    ax_kl.plot(ns, [row["kl_estimate"] for row in rows], ":", label="estimator E[D^(p(y))]")
    ax_kl.axhline(bon_kl_max(p, r), color="grey", lw=0.8, label="-log p(top level)")
    ax_kl.set(xlabel="n", ylabel="KL(best-of-n || p)  [nats]", title="KL divergence")
    ax_win.plot(ns, [row["win_rate"] for row in rows], "o-", ms=3, label="exact win rate")
    ax_win.plot(ns, [row["win_rate_bound"] for row in rows], "--", label="n/(n+1) (bound)")
    ax_win.set(xlabel="n", ylabel="win rate against p", title="Win rate")
    for ax in (ax_kl, ax_win):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path
