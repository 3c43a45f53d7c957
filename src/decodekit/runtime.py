"""Process-wide runtime setup: how many CPU threads torch uses, and progress bars.

STYLE.md item 9: threading setup lives in this one explicit place and happens only
when a caller asks for it (`set_threads`), never as an import side effect.

Why choose threads at all: torch's default is one intra-op thread per visible core.
A decode step of a small model is a few sub-millisecond matmuls, so splitting each
across threads costs more in synchronisation than it saves, and when another process
holds a core the threads spin-wait on a worker that is not running (issue 13 item 9:
19 tok/s with the default against 230 tok/s with one thread on a busy 2-core machine).
The rule and the measurements behind it are in BENCHMARKS.md, section "Threads"
(benchmarks/threads.py).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# Below this size always one thread. On the idle 2-core dev machine two threads decoded
# 1.5-2.1x faster than one from 25M parameters up, but only 1.2x at 3.4M and 1.0x at 0.2M,
# while a busy second core made two threads 4.6-27x slower at 3.4-25M (BENCHMARKS.md,
# "Threads"). From 10M the gain when a core is free is worth the risk the load check leaves.
MULTITHREAD_MIN_PARAMETERS = 10_000_000


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Whole cores allowed by a cgroup v2 `cpu.max` quota ("max 100000" = no quota), or None."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, int(quota) // int(period))


def available_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup quota."""
    # macOS and Windows have no affinity call.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return max(1, min(cores, limit) if limit is not None else cores)


def other_load() -> float:
    """Cores' worth of runnable work from other processes: the 1-minute load average,
    scaled to our share of the machine's CPUs, less our own share of it.

    The load average is host-wide where a container sees the host's; scaling by
    available/cpu_count assumes that load spreads evenly. The load average is an
    exponential average with a 60 s time constant, so one thread that has just run for t
    seconds adds 1 - exp(-t/60); that is subtracted with t our CPU time so far (exact for
    one thread, too little for several, which errs towards fewer threads). Meant for
    start-up, as `set_threads` is: CPU time spent long ago would be subtracted too.
    """
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform
        return 0.0
    scaled = load * available_cores() / (os.cpu_count() or 1)
    own = 1.0 - math.exp(-time.process_time() / 60.0)
    return max(0.0, scaled - own)


def choose_threads(parameters: int | None = None) -> int:
    """Threads for a model of `parameters` weights (BENCHMARKS.md, "Threads").

    One below MULTITHREAD_MIN_PARAMETERS, and for an unknown size: one thread is never far
    from the best there, while two on a busy core are 2-27x slower. From that size on, the
    cores left free by other processes (`available_cores() - other_load()`, rounded), at
    least one: a thread whose core is taken spin-waits and slows every other thread.
    """
    if parameters is None or parameters < MULTITHREAD_MIN_PARAMETERS:
        return 1
    cores = available_cores()
    free = int(cores - other_load() + 0.5)
    return max(1, min(cores, free))


def count_parameters(model: Any) -> int | None:
    """Weights of a LanguageModel (`num_parameters()`) or a torch module; None when unknown."""
    if hasattr(model, "num_parameters"):
        count = int(model.num_parameters())
        return count or None  # the base class answers 0 for "unknown"
    if hasattr(model, "parameters"):
        return sum(p.numel() for p in model.parameters())
    return None


def set_threads(threads: int | None, model: Any = None) -> int:
    """Set torch's intra-op threads (None: `choose_threads` for `model`'s size); returns the number used.

    Inter-op threads are left alone: decodekit runs no inter-op parallel work, and
    torch refuses to change them once any parallel work has started.
    """
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads}")
    if threads is None:
        threads = choose_threads(count_parameters(model) if model is not None else None)
    import torch

    torch.set_num_threads(threads)
    return threads


def progress(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str | None = None,
    enabled: bool | None = None,
):
    """Progress on stderr: a tqdm bar on a terminal, else (when `enabled`) a `ProgressLines`
    line every few seconds, so a long command run off a terminal (a log, CI, a pipe) does not
    look hung (issue 26). `enabled=None` means "stderr is a terminal". Disabled, it only iterates."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if enabled and not sys.stderr.isatty():
        return ProgressLines(iterable, total=total, desc=desc)
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def advance_to(bar, n: float) -> None:
    """Move a progress bar (tqdm or ProgressLines) forward to `n` units, a fraction of a unit
    allowed: a unit that takes minutes (a training, a batch of samples) shows its own progress
    within (issue 35: `eval alignment` read 0/21 for ten minutes). Two decimals, so that the
    bar reads 1.37/21 and not a float's rounding; never backwards."""
    n = round(n, 2)
    if n > bar.n:
        bar.update(n - bar.n)
        bar.n = n  # exactly, past update's float sum


def within_unit(bar):
    """For the unit of `bar` about to run: a callback that puts the bar at a share (0 to 1)
    of it, for work that reports its own progress (a timing's runs, a training's steps).
    The caller ends the unit with callback(1.0), not bar.update(), which would add a unit
    to the share already shown."""
    start = bar.n
    return lambda share: advance_to(bar, start + min(max(share, 0.0), 1.0))


PROGRESS_INTERVAL = 10.0  # seconds between ProgressLines' lines


class ProgressLines:
    """tqdm's interface (iterate, update, set_postfix_str, write, close, with) writing a line
    `desc: done/total (pct), rate/s, elapsed s` to stderr every `interval` seconds while it
    runs, from a timer thread so that a long step still shows the command is alive, and a
    last line when it closes if it printed any."""

    def __init__(self, iterable: Iterable | None = None, *, total: int | None = None,
                 desc: str | None = None, interval: float | None = None):
        import threading

        if total is None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.iterable, self.total, self.desc = iterable, total, desc or "progress"
        self.interval = PROGRESS_INTERVAL if interval is None else interval
        self.disable = False  # tqdm's attribute: callers that print beside a bar read it
        self.n, self.postfix, self.start, self.printed = 0, "", time.monotonic(), False
        self._done = threading.Event()
        self._timer = threading.Thread(target=self._tick, daemon=True, name=f"progress {self.desc}")
        self._timer.start()

    def _tick(self) -> None:
        while not self._done.wait(max(self.interval, 0.05)):
            self._line()

    def _line(self, last: bool = False) -> None:
        elapsed = time.monotonic() - self.start
        done = f"{self.n:g}/{self.total} ({self.n / self.total:.0%})" if self.total else f"{self.n:g}"
        rate = f"{self.n / elapsed:.2f}/s" if elapsed > 0 else "-"
        postfix = f", {self.postfix}" if self.postfix else ""
        state = f"done in {elapsed:.0f} s" if last else f"{elapsed:.0f} s"
        print(f"{self.desc}: {done}, {rate}, {state}{postfix}", file=sys.stderr, flush=True)
        self.printed = True

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        self.postfix = text

    def write(self, text: str) -> None:
        """A line of the caller's own, on stdout as tqdm.write puts it."""
        print(text, flush=True)

    def close(self) -> None:
        if self._done.is_set():
            return
        self._done.set()
        self._timer.join()
        if self.printed or time.monotonic() - self.start >= self.interval:
            self._line(last=True)

    def __iter__(self):
        try:
            for item in self.iterable:
                yield item
                self.n += 1
        finally:
            self.close()

    def __enter__(self) -> ProgressLines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
