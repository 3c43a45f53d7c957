"""Where the engine's compilations run, so that none can touch a serving step (issue 37).

Tracing a step patches process-wide hooks for as long as it runs: torch.fx's `Tracer.trace`
(AOTAutograd's make_fx, inductor's pattern passes) replaces `torch.nn.Module.__call__` and
`__getattr__` for the whole process, so an eager forward in another thread at that moment
runs through the tracer's `module_call_wrapper` (a step failed with `NameError: module is not
installed as a submodule`). And a thread still compiling when the interpreter exits aborts it
(`terminate called without an active exception`, SIGABRT). So a compilation never runs
beside a step:

- The cold compile (seconds to a minute) runs in a child process (`CompileJob`): it rebuilds
  the model's modules from their shapes alone (meta tensors: no weight is copied), compiles
  the same step for the same bucket with the same options, which fills inductor's and
  AOTAutograd's caches on disk (`TORCHINDUCTOR_CACHE_DIR`), and exits. Its own interpreter,
  hooks and GIL; a lower priority (nice 10); ended by the parent's exit (`_end_jobs`), so
  nothing keeps a process from exiting or outlives it.
- The engine then compiles the bucket in its own process, on its stepping thread, before a
  step (`StepGate.alone`): from those caches that is dynamo's trace and loading the kernels
  (BENCHMARKS.md, "Compilation beside serving"), and no engine of the process steps
  meanwhile (steps enter `StepGate.step`).
"""

from __future__ import annotations

import atexit
import copy
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch


class StepGate:
    """Engine steps enter together; an in-process compilation runs alone, between them. A
    thread inside a step cannot wait for the others to end (it would wait for itself):
    `alone` says so, and the compilation waits for the next step's start."""

    def __init__(self):
        self._cond = threading.Condition()
        self._steps = 0
        self._alone = False  # a compilation runs, or waits for the running steps to end
        self._depth = threading.local()

    @contextmanager
    def step(self):
        depth = getattr(self._depth, "value", 0)
        with self._cond:
            if not depth:  # a nested step (an engine stepping inside another's step) never waits
                self._cond.wait_for(lambda: not self._alone)
            self._steps += 1
        self._depth.value = depth + 1
        try:
            yield
        finally:
            self._depth.value = depth
            with self._cond:
                self._steps -= 1
                self._cond.notify_all()

    def alone(self, work) -> bool:
        """Run `work()` while no step runs; False (and nothing run) from inside a step or
        while another compilation runs."""
        with self._cond:
            if getattr(self._depth, "value", 0) or self._alone:
                return False
            self._alone = True
            self._cond.wait_for(lambda: self._steps == 0)
        try:
            work()
        finally:
            with self._cond:
                self._alone = False
                self._cond.notify_all()
        return True


STEPS = StepGate()  # every engine of the process: a compilation traces while none steps


class CompileJob:
    """One bucket compiled in a child process (module docstring): `done()` polls it without
    waiting; `error` is None when it compiled, else what failed."""

    def __init__(self, model, name: str, prefixed: bool, example: tuple, backend, options: dict,
                 span: int = 1):  # fmt: skip
        self.folder = Path(tempfile.mkdtemp(prefix="decodekit-compile-"))
        self.started = time.perf_counter()
        self.seconds = 0.0
        self.error: str | None = None
        skeleton = _skeleton(model.net)
        job = {"net": skeleton, "config": model.config, "name": name, "prefixed": prefixed, "span": span,
               "example": [t.to("meta") for t in example], "device": str(model.device),
               "backend": backend, "options": options}  # fmt: skip
        torch.save(job, self.folder / "job.pt")
        self._log = open(self.folder / "log.txt", "wb")  # noqa: SIM115 -- the child writes it until it ends
        self.process = subprocess.Popen(
            [sys.executable, "-m", "decodekit.engine.compile_worker", str(self.folder)],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        with _JOBS_LOCK:
            _JOBS.add(self)

    def done(self) -> bool:
        """Whether the child has ended (then `error` and `seconds` are set); never waits."""
        if self.process.poll() is None:
            return False
        self._finish()
        return True

    def wait(self) -> None:
        self.process.wait()
        self._finish()

    def end(self) -> None:
        """Stop the child (the process exits, or the engine no longer wants the bucket)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._finish()

    def _finish(self) -> None:
        if self._log.closed:
            return
        self._log.close()
        self.seconds = time.perf_counter() - self.started
        result = _read_json(self.folder / "result.json")
        if result.get("ok"):
            self.seconds = float(result["seconds"])
        else:
            tail = (self.folder / "log.txt").read_text(errors="replace").strip().splitlines()[-3:]
            self.error = result.get("error") or f"exit code {self.process.returncode}: {' | '.join(tail)}"
        shutil.rmtree(self.folder, ignore_errors=True)
        with _JOBS_LOCK:
            _JOBS.discard(self)


_JOBS: set[CompileJob] = set()
_JOBS_LOCK = threading.Lock()


@atexit.register
def _end_jobs() -> None:
    """The process exits: its compilations end with it."""
    with _JOBS_LOCK:
        jobs = list(_JOBS)
    for job in jobs:
        job.end()


def _skeleton(net: torch.nn.Module) -> torch.nn.Module:
    """A copy of `net` whose parameters and buffers are meta tensors of the same shapes,
    dtypes, strides and requires_grad (tied weights stay tied): what a compilation and its
    cache key depend on, without the weights."""
    memo = {}
    for tensor in itertools.chain(net.parameters(), net.buffers()):
        meta = tensor.detach().to("meta")
        if isinstance(tensor, torch.nn.Parameter):  # requires_grad is part of the graph's cache key
            meta = torch.nn.Parameter(meta, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = meta
    return copy.deepcopy(net, memo)


def _materialize(net: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`_skeleton`'s copy with uninitialised tensors on `device`, in place; tied weights stay
    one tensor (`Module.to_empty` would untie them, and the compiled graph would differ)."""
    made: dict[int, torch.Tensor] = {}
    for module in net.modules():
        for table in (module._parameters, module._buffers):
            for name, meta in table.items():
                if meta is not None and id(meta) not in made:
                    tensor = torch.empty_like(meta, device=device)
                    if isinstance(meta, torch.nn.Parameter):
                        tensor = torch.nn.Parameter(tensor, requires_grad=meta.requires_grad)
                    made[id(meta)] = tensor
                if meta is not None:
                    table[name] = made[id(meta)]
    return net


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def main(folder: str) -> int:
    """The child: compile the job in `folder` and write result.json."""
    from decodekit.engine.lanes import compile_step
    from decodekit.models.native import NativeLM

    os.nice(10)  # serving first: the parent's steps run at the normal priority
    path = Path(folder)
    start = time.perf_counter()
    try:
        job = torch.load(path / "job.pt", weights_only=False)
        device = torch.device(job["device"])
        net = _materialize(job["net"], device)
        model = NativeLM(net, job["config"])
        example = tuple(torch.zeros_like(t, device=device) for t in job["example"])
        options, span = job["options"], job["span"]
        compile_step(model, job["name"], job["prefixed"], example, job["backend"], options, span)
    except Exception as error:  # noqa: BLE001 -- reported to the parent, whose engine stays eager
        failure = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        (path / "result.json").write_text(json.dumps(failure))
        return 1
    (path / "result.json").write_text(json.dumps({"ok": True, "seconds": time.perf_counter() - start}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
