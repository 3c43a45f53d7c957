"""A model's compiled decode steps (`CompiledLanes`, one per bucket of rows) and the shared
prefixes they read (`PrefixKV`).

The step itself is compiled.py's `lanes_step`; when a bucket is compiled is compile_policy.py's
choice; where the compilation runs is compile_worker.py's. `CompiledLanes.run` replays a ready
bucket, its rows padded to the bucket's size.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from decodekit.engine import compiled
from decodekit.engine.compile_worker import STEPS, CompileJob
from decodekit.engine.compiled import bucket, bucket_name, lanes_step
from decodekit.models import kernels
from decodekit.models.base import weights_stamp
from decodekit.models.native import NativeLM

if TYPE_CHECKING:
    from decodekit.engine.compile_policy import CompilePolicy

_log = logging.getLogger(__name__)


def compile_options(backend, cpp_wrapper: bool = True, model: NativeLM | None = None) -> dict:
    """torch.compile's options for a bucket's step (`cpp_wrapper=False`: inductor's Python
    wrapper, for a step a CUDA graph replays: cuda_graphs.py). A `model` with biased layers
    gets the Python wrapper too (`has_biases`)."""
    # No guards on the model's modules: these steps belong to one model object and its
    # weights as they are (`lanes_for` builds new ones when they change), and checking each
    # parameter on every call cost 0.65 ms a token at 240M (int4, 16 layers).
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    if backend == "inductor" and cpp_wrapper and not (model is not None and has_biases(model)):
        # The graph's wrapper in C++, not Python: its ~50 buffer checks and each kernel's
        # call leave the interpreter (0.30 -> 0.25 ms a step of `shakespeare`, int8/int4
        # alike; a cold compile measured no longer, 18 s against 22 s).
        options["cpp_wrapper"] = True
    return options


def has_biases(model: NativeLM) -> bool:
    """Whether any layer of the model has a bias, which its linear op takes as an argument
    (models/kernels.py, qlinear.py). torch 2.13's inductor C++ wrapper corrupts the heap around
    such a call: `qwen2.5-0.5b` with 16 or more layers (its q/k/v biases), compiled on an
    AVX-512 Zen 4, aborted in its first compiled step ("free(): invalid pointer", "corrupted
    size vs. prev_size"), float32, int8 and int4 alike, while the same model without its
    biases, with the Python wrapper, with the biases added outside the op, or with the kernels
    off ran (2026-11-28, BENCHMARKS.md "A crash of the compiled step with biases"). Such a
    model's steps take inductor's Python wrapper."""
    return any(isinstance(getattr(module, "bias", None), torch.Tensor) for module in model.net.modules())


def compile_step(model: NativeLM, name: str, prefixed: bool, example: tuple, backend, options: dict,
                 span: int = 1):  # fmt: skip
    """The bucket's step compiled and run once on `example` (which compiles it): in the
    engine's process (`CompiledLanes`) or in a compile worker's (compile_worker.py)."""
    kernels.register_fakes()
    step = lanes_step(model, name, prefixed, span)
    compiled = torch.compile(step, backend=backend, dynamic=False, fullgraph=True, options=options)
    with torch.inference_mode():
        _mark_dynamic(*example[3:5])
        if prefixed:
            _mark_dynamic(*example[5:7], rows=False)
        compiled(*example)
    return compiled


@dataclass
class CompiledLanes:
    """A model's compiled decode steps, one per bucket (and per bucket with a shared prefix),
    shared by its engines (`lanes_for`); compiled when an engine's policy says so; `run` uses
    a bucket once it is ready.

    Where compilation runs (compile_worker.py): with the automatic policy a child process
    compiles the bucket first, filling the on-disk caches, and `poll` then compiles it here
    from them; with `compile=True`, `poll` compiles it here at once. Either way `poll` runs
    before a step, on the stepping thread, while no engine of the process steps."""

    model: NativeLM
    span: int = 1  # tokens a row: 1 decodes, T > 1 verifies T tokens (compiled.py `lanes_step`)
    ready: dict[tuple[int, bool], object] = field(default_factory=dict)  # (bucket, prefixed) -> step
    failed: str | None = None
    writes_rows: bool = False  # its steps leave the rows to the engine (cuda_graphs.py's may not)
    load_seconds: list[float] = field(default_factory=list)  # each in-process compilation's time
    _pending: set[tuple[int, bool]] = field(default_factory=set)
    _jobs: dict = field(default_factory=dict)  # key -> (CompileJob, example, policy): in a child
    _due: dict = field(default_factory=dict)  # key -> (example, policy, seconds or None): for `poll`
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _marked: list = field(default_factory=lambda: [None, None])  # the keys last marked dynamic: rows, prefix

    def want(self, rows: int, policy: CompilePolicy, decode_steps: int, eager_step_s: float,
             running_kv, prefixed: bool = False) -> None:  # fmt: skip
        """Ask for the bucket of `rows` if `policy` says it pays: compiled by a child process
        and then by `poll` (with `policy.mode` True, by the next `poll` at once)."""
        size = bucket(rows)
        key = (size, prefixed)
        with self._lock:
            if size is None or self.failed or key in self.ready or key in self._pending:
                return
            if not policy.pays(size, decode_steps, eager_step_s, prefixed):
                return
            self._pending.add(key)
        example = _example_inputs(self.model, size, running_kv, prefixed, self.span)
        if policy.mode:
            with self._lock:
                self._due[key] = (example, policy, None)
            return
        try:
            options = compile_options(compiled.BACKEND, model=self.model)
            name = _step_name(key, self.span)
            job = CompileJob(self.model, name, prefixed, example, compiled.BACKEND, options, self.span)
        except Exception as error:  # noqa: BLE001 -- the engine stays eager, the request is fine
            self._fail(f"{type(error).__name__}: {error}", key)
            return
        with self._lock:
            self._jobs[key] = (job, example, policy)

    @property
    def compiling(self) -> list[str]:
        """The buckets being compiled, or compiled by a child and waiting for `poll`."""
        with self._lock:
            return sorted(bucket_name(*key) for key in self._pending)

    def poll(self) -> None:
        """Between steps, never inside one: take the children's results, and compile here
        the buckets that are due while no engine of the process steps (compile_worker.py)."""
        if not self._pending:
            return
        with self._lock:
            finished = [(key, entry) for key, entry in self._jobs.items() if entry[0].done()]
            for key, (job, example, policy) in finished:
                del self._jobs[key]
                if job.error is None:
                    self._due[key] = (example, policy, job.seconds)
        for key, (job, _, _) in finished:
            if job.error is not None:
                self._fail(job.error, key)
        while self._due:
            with self._lock:
                if not self._due:
                    break
                key, (example, policy, seconds) = self._due.popitem()
            if not STEPS.alone(lambda: self._compile(key, example, policy, seconds)):  # noqa: B023 -- run at once
                with self._lock:
                    self._due[key] = (example, policy, seconds)  # the next step's poll
                return

    def wait(self) -> None:
        """Wait for the children's compilations and compile their buckets here (tests,
        benchmarks)."""
        for job, _, _ in list(self._jobs.values()):
            job.wait()
        self.poll()

    def end(self) -> None:
        """Stop the children's compilations (their buckets stay eager)."""
        with self._lock:
            jobs, self._jobs = self._jobs, {}
            self._pending.difference_update(jobs)
        for job, _, _ in jobs.values():
            job.end()

    def _compile(self, key: tuple[int, bool], example, policy: CompilePolicy, seconds: float | None) -> None:
        size, prefixed = key
        start = time.perf_counter()
        try:
            options = compile_options(compiled.BACKEND, model=self.model)
            step = compile_step(self.model, _step_name(key, self.span), prefixed, example, compiled.BACKEND,
                                options, self.span)  # fmt: skip
        except Exception as error:  # noqa: BLE001 -- the engine stays eager, the request is fine
            self._fail(f"{type(error).__name__}: {error}", key)
            return
        elapsed = time.perf_counter() - start
        with self._lock:
            self.ready[key] = step
            self._pending.discard(key)
            self.load_seconds.append(elapsed)
        policy.record(size, elapsed if seconds is None else seconds, prefixed)
        _log.info("compiled the decode step for %s in %.1f s here%s", bucket_name(size, prefixed), elapsed,
                  "" if seconds is None else f" ({seconds:.1f} s in a compile worker)")  # fmt: skip

    def _fail(self, error: str, key: tuple[int, bool]) -> None:
        with self._lock:
            self.failed = error
            self._pending.discard(key)
        message = f"the compiled decode step failed; the engine stays eager ({error:.200})"
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def run(self, rows: int, tokens, positions, stored, running_kv, prefix=None, bounds=None):
        """The compiled step for `rows` RunningKV rows, or None when its bucket is not ready.
        tokens, positions, stored [rows] (compiled.py `lanes_step`); prefix: the step's shared
        prefixes (a `PrefixKV`), whose span [start, end) each row sees in `bounds` [2, rows],
        or None. Returns logits [rows, V], new keys/values [N, rows, H_kv, D]."""
        size = bucket(rows)
        compiled = self.ready.get((size, prefix is not None))
        if compiled is None:
            return None
        running_kv.reserve_rows(size)
        keys, values = running_kv.keys, running_kv.values
        pad = size - rows
        if pad:
            tokens, positions, stored = (torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
                                         for x in (tokens, positions, stored))  # fmt: skip
        if self._marked[0] is not keys:  # regrown since the last step
            _mark_dynamic(keys, values)
            self._marked[0] = keys
        tokens = tokens if self.span > 1 else tokens[:, None]  # [B, T]
        if prefix is None:
            logits, new_keys, new_values = compiled(tokens, positions, stored, keys, values)
        else:
            if pad:
                bounds = torch.cat([bounds, bounds.new_zeros(2, pad)], dim=1)
            if self._marked[1] is not prefix.keys:
                _mark_dynamic(prefix.keys, prefix.values, rows=False)
                self._marked[1] = prefix.keys
            logits, new_keys, new_values = compiled(tokens, positions, stored, keys, values,
                                                    prefix.keys, prefix.values, bounds)  # fmt: skip
        return logits[:rows], new_keys[:, :rows], new_values[:, :rows]


def _step_name(key: tuple[int, bool], span: int = 1) -> str:
    """A bucket's code object name (`lanes_step`)."""
    size, prefixed = key
    kind = "decode_step" if span == 1 else f"verify_{span}_step"
    return f"{kind}_{size}_rows" + ("_prefixed" if prefixed else "")


def lanes_for(model: NativeLM, span: int = 1) -> CompiledLanes:
    """The model's compiled steps of `span` tokens a row, kept on the model (every engine of
    it, and a later one, reuses them); new ones when its weights changed (a compressed or
    reloaded model)."""
    stamp = weights_stamp(model)
    attribute = "_decodekit_lanes" if span == 1 else f"_decodekit_lanes_{span}"
    with _LANES_LOCK:
        built_on, lanes = model.__dict__.get(attribute, (None, None))
        if lanes is None or built_on != stamp:
            lanes = CompiledLanes(model, span)
            model.__dict__[attribute] = (stamp, lanes)
        return lanes


_LANES_LOCK = threading.Lock()


def _mark_dynamic(keys: torch.Tensor, values: torch.Tensor, rows: bool = True) -> None:
    """The RunningKV capacity (rows, positions) and a shared prefix's length are dynamic: one
    graph per bucket."""
    for tensor in (keys, values):
        if rows:
            torch._dynamo.maybe_mark_dynamic(tensor, 1)
        torch._dynamo.maybe_mark_dynamic(tensor, 3)


def _example_inputs(model: NativeLM, size: int, running_kv, prefixed: bool = False, span: int = 1):
    """Inputs of a bucket's shapes, for a compilation in the background (the live rows are
    never touched there)."""
    keys = running_kv.keys
    n, _, kv_heads, _, dim = keys.shape
    shape = (n, max(size, 2) + 1, kv_heads, 67, dim)  # sizes not 0/1 and unequal (no shared symbols)
    example_keys = torch.zeros(shape, dtype=keys.dtype, device=keys.device)
    tokens = torch.zeros((size, span), dtype=torch.long, device=keys.device)
    positions = torch.zeros((size, span) if span > 1 else size, dtype=torch.long, device=keys.device)
    stored = torch.zeros(size, dtype=torch.long, device=keys.device)
    example = (tokens, positions, stored, example_keys, example_keys.clone())
    if not prefixed:
        return example
    prefix_keys = torch.zeros((n, 1, kv_heads, 37, dim), dtype=keys.dtype, device=keys.device)
    bounds = torch.zeros((2, size), dtype=torch.long, device=keys.device)
    return (*example, prefix_keys, prefix_keys.clone(), bounds)


@dataclass(eq=False)
class PrefixKV:
    """The shared prefixes of a step's rows, one after another: keys, values [N, 1, H_kv, P,
    D] and where each starts. One prefix is used as it is; several are joined once, and kept
    while the same prefixes run (`for_rows`)."""

    prefixes: tuple  # rows.py SharedPrefix, in order
    keys: torch.Tensor
    values: torch.Tensor
    starts: dict[int, int]  # id(prefix) -> its first position

    @classmethod
    def for_rows(cls, prefixes: list, previous: PrefixKV | None) -> PrefixKV | None:
        """The PrefixKV of these rows' prefixes (None for a row of its own); `previous` when
        it holds the same ones; None when no row continues one."""
        distinct = tuple({id(p): p for p in prefixes if p is not None}.values())
        if not distinct:
            return None
        if previous is not None and len(previous.prefixes) == len(distinct) and all(
                a is b for a, b in zip(previous.prefixes, distinct, strict=True)):  # fmt: skip
            return previous
        starts, total = {}, 0
        for prefix in distinct:
            starts[id(prefix)] = total
            total += prefix.length
        if len(distinct) == 1:
            return cls(distinct, distinct[0].keys, distinct[0].values, starts)
        keys = torch.cat([p.keys for p in distinct], dim=3)
        return cls(distinct, keys, torch.cat([p.values for p in distinct], dim=3), starts)

    def bounds(self, prefixes: list) -> list[list[int]]:
        """[starts, ends] of each row's prefix (0, 0 for a row of its own)."""
        spans = [(self.starts[id(p)], self.starts[id(p)] + p.length) if p is not None else (0, 0)
                 for p in prefixes]  # fmt: skip
        return [[a for a, _ in spans], [b for _, b in spans]]
