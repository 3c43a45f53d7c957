"""The compiled decode step: the engine's decoding rows through one compiled graph (issue 25).

Most engine steps only decode: every scheduled sequence holds a RunningKV lane (rows.py)
and feeds one token. Eager, such a step costs about a hundred ATen calls dispatched from
Python per layer stack plus `build_batch`'s index tensors; on a small model that overhead,
not arithmetic, is the token's time. vLLM removes it by compiling the model's decode step
and replaying it per batch-size bucket (CUDA graphs); gpt-fast by one static-shape compiled
step (models/static.py). Here:

- `lanes_step(model)` is the decode step over B rows with NativeLM's own modules
  (`LlamaNet.forward` with `LaneAttention` as its cache): tokens [B, 1], positions [B], the
  RunningKV keys and values read-only, and `visible` [B, 1, 1, C] (each row's stored
  positions). Attention is `decode_attention` (models/attention.py), traced in its written-out
  form, over each row and its own new key passed beside it (`new`), so the graph mutates
  nothing; it returns the logits and the new keys and values [N, B, H_kv, D], which the engine
  then writes into the rows and the pool (two index writes for all layers, not two per layer).
- One `torch.compile` per bucket of rows (1, 2, 4, ..., 64; padded rows see nothing and
  their output is dropped), static in B, dynamic in the RunningKV capacity (rows and
  positions), so a bucket compiles once whatever the lengths. The kernels of
  models/kernels.py run inside the graph (their fake kernels: `kernels.register_fakes`).
- Rows that continue a shared prefix (the n samples of a prompt, rows.py) read it once for
  all of them in the graph too: one variant of each bucket also takes the step's prefixes'
  keys and values, one after another [N, 1, H_kv, P, D] (P dynamic), and each row's span of
  them [start, end) (empty for a row of its own), and its queries attend over [its span,
  its row, its new key] with one softmax (the eager step merges the prefix's attention by
  log-sum-exp, rows.py). Several requests' prefixes are joined once and kept while the
  same prefixes run (`PrefixKV`).
- Prompts, verification spans, forks, sliding windows, a quantised KV pool and the
  batch-invariant mode stay on the eager path (`eligible`).

When to compile (`CompilePolicy`): compilation costs seconds to a minute (inductor caches
its kernels on disk, `TORCHINDUCTOR_CACHE_DIR`, so a later process pays only the tracing);
a step saves a fraction of a millisecond. So the engine runs eager and compiles a bucket, in
a child process and then between two steps (compile_worker.py: a compilation never runs
beside a step), once the decode-only steps it has already run would have repaid that
bucket's warm-up (a JIT's tiering: past work predicts future work), and automatically only
for buckets of up to 8 rows, where the step is overhead-bound. The warm-up of each bucket of
each model shape is measured and remembered on disk (`compile-times.json` in decodekit's cache directory,
cache_dir.py), so a short
command such as `decodekit generate "ROMEO:"` never waits for a compile. `compile=True`
compiles before the second decode step, in the engine's process, `False` never. A
compilation that fails leaves the engine eager with one warning; a request never fails
for it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from decodekit.cache_dir import cache_dir
from decodekit.engine.compile_worker import STEPS, CompileJob
from decodekit.models import kernels
from decodekit.models.attention import SharedKV, decode_attention
from decodekit.models.base import weights_stamp
from decodekit.models.native import NativeLM

_log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
BACKEND = "inductor"  # torch.compile's backend (the tests also run "aot_eager", which compiles in seconds)
# Before a model's warm-up has been measured on this machine: what a cold compile of a small
# model's step costs on a 2-core CPU (BENCHMARKS.md, "Compiled decode step").
COLD_WARMUP_S = 40.0
# The share of an eager decode step the compiled one saves (1.3-1.5x measured at one row).
ASSUMED_SAVING = 0.3
# The automatic policy compiles buckets up to this many rows: beyond, a step's matmuls and
# attention outweigh its overhead and compiling gained nothing (64 rows: 1.27x against 1.25x
# Hugging Face, BENCHMARKS.md), while a background compile slows a busy server for its length.
AUTO_MAX_ROWS = 8


def bucket(rows: int) -> int | None:
    """The smallest bucket holding `rows`, or None above the largest."""
    return next((b for b in BUCKETS if b >= rows), None)


def bucket_name(size: int, prefixed: bool = False) -> str:
    """A compiled step's name in the policy's records: its rows, and whether it also takes a
    shared prefix (module docstring)."""
    return f"rows={size}" + ("+prefix" if prefixed else "")


class LaneAttention:
    """The cache `LlamaNet.forward` attends through in a compiled step: B rows of one new
    token each over their RunningKV rows, and over a shared prefix for the rows that continue
    it (module docstring). Records the new keys/values."""

    def __init__(self, keys, values, visible, prefix=None):  # visible [B, 1, 1, C] bool
        self.keys, self.values, self.visible = keys, values, visible
        self.prefix = prefix  # None, or keys, values [N, 1, H_kv, P, D] and sees [B, 1, 1, P] bool
        self.new_keys: list[torch.Tensor] = []
        self.new_values: list[torch.Tensor] = []

    def attend(self, layer, q, k, v, mask, causal, per_query=False) -> torch.Tensor:
        """q [B, 1, H, D], k/v [B, 1, H_kv, D] -> [B, 1, H, D]."""
        batch = q.shape[0]
        prefixes = ()
        if self.prefix is not None:  # the step's prefixes, joined: each row sees its span
            keys, values, sees = self.prefix
            prefixes = (SharedKV(keys[layer], values[layer], sees=sees),)
        out = decode_attention(q[:, 0], self.keys[layer, :batch], self.values[layer, :batch],
                               self.visible, new=(k[:, 0], v[:, 0]), prefixes=prefixes)  # fmt: skip
        self.new_keys.append(k[:, 0])
        self.new_values.append(v[:, 0])
        return out[:, None]


def lanes_step(model: NativeLM, name: str = "decode_step", prefixed: bool = False):
    """step(tokens [B, 1], positions [B], stored [B], keys, values [N, R, H_kv, C, D]) ->
    logits [B, V] float32, new keys and values [N, B, H_kv, D] (module docstring). positions:
    each token's position in its sequence (RoPE); stored: the positions its row holds before
    it (a padded row: 0, it sees only its own key). `prefixed`: the step also takes shared
    prefixes' keys and values [N, 1, H_kv, P, D] and each row's span of them, bounds [2, B]
    (start, end; a row that continues a prefix holds only the positions after it).

    Each call returns a function with its own code object, called `name`: dynamo keeps its
    compiled graphs per code object, at most 8, so the buckets of every engine in a process
    must not share one."""
    net, config = model.net, model.config
    cos_table, sin_table = model.rope.tables(model.max_context)
    masks = [(None, False)] * config.num_layers

    def step(tokens, positions, stored, keys, values, prefix_keys=None, prefix_values=None, bounds=None):
        columns = torch.arange(keys.shape[3], device=keys.device)
        visible = (columns[None, :] < stored[:, None])[:, None, None]  # [B, 1, 1, C]
        cos = cos_table.index_select(0, positions)[:, None, None]  # [B, 1, 1, D]
        sin = sin_table.index_select(0, positions)[:, None, None]
        prefix = None
        if prefixed:
            spans = torch.arange(prefix_keys.shape[3], device=keys.device)[None, :]  # [1, P]
            sees = (spans >= bounds[0][:, None]) & (spans < bounds[1][:, None])  # [B, P]
            prefix = (prefix_keys, prefix_values, sees[:, None, None])
        cache = LaneAttention(keys, values, visible, prefix)
        logits = net(tokens, cos, sin, cache, masks)  # [B, 1, V]
        return logits[:, 0], torch.stack(cache.new_keys), torch.stack(cache.new_values)

    code = step.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, step.__globals__, name, step.__defaults__, step.__closure__)


def eligible(model, pool, batch_invariant: bool) -> str | None:
    """Why this engine cannot use the compiled step, or None if it can."""
    if not isinstance(model, NativeLM):
        return f"{type(model).__name__} is not a NativeLM"
    if batch_invariant:
        return "the batch-invariant mode attends per query"
    if any(window is not None for window in model.config.layer_windows):
        return "sliding-window layers"
    if model.config.rope.kind == "dynamic":
        return "dynamic RoPE (its tables change with the length)"
    if pool.keys.dtype != model.dtype:
        return f"the KV pool stores {pool.keys.dtype}, not the model's {model.dtype}"
    return None


@dataclass
class CompilePolicy:
    """When the engine compiles a bucket (module docstring). mode: True, False or None
    (automatic). warmups: the recorded warm-up of each bucket of this model's shape."""

    mode: bool | None
    cache_file: Path
    key: str = ""
    warmups: dict[str, float] = field(default_factory=dict)  # bucket_name -> seconds

    @classmethod
    def for_model(cls, model: NativeLM, mode: bool | None) -> CompilePolicy:
        policy = cls(mode, cache_dir() / "compile-times.json", shape_key(model))
        for name, seconds in _read_json(policy.cache_file).items():
            shape, _, bucket_of = name.rpartition("/")
            if shape == policy.key and bucket_of.startswith("rows="):
                policy.warmups[bucket_of] = float(seconds)
        return policy

    def pays(self, size: int, decode_steps: int, eager_step_s: float, prefixed: bool = False) -> bool:
        """Whether the decode-only steps run so far would have repaid the bucket's warm-up
        (automatic mode: buckets up to AUTO_MAX_ROWS rows, where the step is overhead-bound)."""
        if self.mode is not None:
            return self.mode
        if size > AUTO_MAX_ROWS:
            return False
        warmup = self.warmups.get(bucket_name(size, prefixed), COLD_WARMUP_S)
        return decode_steps * eager_step_s * ASSUMED_SAVING >= warmup

    def record(self, size: int, seconds: float, prefixed: bool = False) -> None:
        """Remember a measured warm-up of this shape's bucket of `size` rows."""
        name = bucket_name(size, prefixed)
        self.warmups[name] = seconds
        times = _read_json(self.cache_file)
        times[f"{self.key}/{name}"] = round(seconds, 2)
        try:
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            self.cache_file.write_text(json.dumps(times, indent=1, sort_keys=True))
        except OSError as error:  # a read-only cache costs the next process a guess, no more
            _log.info("could not record the compile time in %s: %s", self.cache_file, error)


def shape_key(model: NativeLM) -> str:
    """The model's shape and dtype, what a compiled step's cost depends on."""
    c = model.config
    dtype = str(model.dtype).removeprefix("torch.")
    return (f"{c.num_layers}x{c.hidden_size}/{c.num_heads}h{c.num_kv_heads}kv/{c.intermediate_size}"
            f"/{c.vocab_size}/{dtype}/torch{torch.__version__}")  # fmt: skip


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def compile_options(backend) -> dict:
    """torch.compile's options for a bucket's step."""
    # No guards on the model's modules: these steps belong to one model object and its
    # weights as they are (`lanes_for` builds new ones when they change), and checking each
    # parameter on every call cost 0.65 ms a token at 240M (int4, 16 layers).
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    if backend == "inductor":
        # The graph's wrapper in C++, not Python: its ~50 buffer checks and each kernel's
        # call leave the interpreter (0.30 -> 0.25 ms a step of `shakespeare`, int8/int4
        # alike; a cold compile measured no longer, 18 s against 22 s).
        options["cpp_wrapper"] = True
    return options


def compile_step(model: NativeLM, name: str, prefixed: bool, example: tuple, backend, options: dict):
    """The bucket's step compiled and run once on `example` (which compiles it): in the
    engine's process (`CompiledLanes`) or in a compile worker's (compile_worker.py)."""
    kernels.register_fakes()
    step = lanes_step(model, name, prefixed)
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
    ready: dict[tuple[int, bool], object] = field(default_factory=dict)  # (bucket, prefixed) -> step
    failed: str | None = None
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
        example = _example_inputs(self.model, size, running_kv, prefixed)
        if policy.mode:
            with self._lock:
                self._due[key] = (example, policy, None)
            return
        try:
            options = compile_options(BACKEND)
            job = CompileJob(self.model, _step_name(key), prefixed, example, BACKEND, options)
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
            options = compile_options(BACKEND)
            compiled = compile_step(self.model, _step_name(key), prefixed, example, BACKEND, options)
        except Exception as error:  # noqa: BLE001 -- the engine stays eager, the request is fine
            self._fail(f"{type(error).__name__}: {error}", key)
            return
        elapsed = time.perf_counter() - start
        with self._lock:
            self.ready[key] = compiled
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
            tokens = torch.cat([tokens, tokens.new_zeros(pad)])
            positions = torch.cat([positions, positions.new_zeros(pad)])
            stored = torch.cat([stored, stored.new_zeros(pad)])
        if self._marked[0] is not keys:  # regrown since the last step
            _mark_dynamic(keys, values)
            self._marked[0] = keys
        if prefix is None:
            logits, new_keys, new_values = compiled(tokens[:, None], positions, stored, keys, values)
        else:
            if pad:
                bounds = torch.cat([bounds, bounds.new_zeros(2, pad)], dim=1)
            if self._marked[1] is not prefix.keys:
                _mark_dynamic(prefix.keys, prefix.values, rows=False)
                self._marked[1] = prefix.keys
            logits, new_keys, new_values = compiled(tokens[:, None], positions, stored, keys, values,
                                                    prefix.keys, prefix.values, bounds)  # fmt: skip
        return logits[:rows], new_keys[:, :rows], new_values[:, :rows]


def _step_name(key: tuple[int, bool]) -> str:
    """A bucket's code object name (`lanes_step`)."""
    size, prefixed = key
    return f"decode_step_{size}_rows" + ("_prefixed" if prefixed else "")


def lanes_for(model: NativeLM) -> CompiledLanes:
    """The model's compiled steps, kept on the model (every engine of it, and a later one,
    reuses them); new ones when its weights changed (a compressed or reloaded model)."""
    stamp = weights_stamp(model)
    with _LANES_LOCK:
        built_on, lanes = model.__dict__.get("_decodekit_lanes", (None, None))
        if lanes is None or built_on != stamp:
            lanes = CompiledLanes(model)
            model.__dict__["_decodekit_lanes"] = (stamp, lanes)
        return lanes


_LANES_LOCK = threading.Lock()


def _mark_dynamic(keys: torch.Tensor, values: torch.Tensor, rows: bool = True) -> None:
    """The RunningKV capacity (rows, positions) and a shared prefix's length are dynamic: one
    graph per bucket."""
    for tensor in (keys, values):
        if rows:
            torch._dynamo.maybe_mark_dynamic(tensor, 1)
        torch._dynamo.maybe_mark_dynamic(tensor, 3)


def _example_inputs(model: NativeLM, size: int, running_kv, prefixed: bool = False):
    """Inputs of a bucket's shapes, for a compilation in the background (the live rows are
    never touched there)."""
    keys = running_kv.keys
    n, _, kv_heads, _, dim = keys.shape
    shape = (n, max(size, 2) + 1, kv_heads, 67, dim)  # sizes not 0/1 and unequal (no shared symbols)
    example_keys = torch.zeros(shape, dtype=keys.dtype, device=keys.device)
    tokens = torch.zeros((size, 1), dtype=torch.long, device=keys.device)
    positions = torch.zeros(size, dtype=torch.long, device=keys.device)
    example = (tokens, positions, positions.clone(), example_keys, example_keys.clone())
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
