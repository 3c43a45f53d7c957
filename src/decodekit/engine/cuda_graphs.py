"""The decode step on a GPU, replayed from CUDA graphs (issue 33): `GraphedLanes`.

On a GPU a small model's decode step is bound by launching its kernels from Python, not by
the GPU (qwen2.5-0.5b in bfloat16 on an H100: ~550 kernel launches a token, the GPU busy
3.3 ms of a 12 ms token). A CUDA graph records the step's kernels once and replays them
with one launch. `GraphedLanes` is the CUDA counterpart of lanes.py's `CompiledLanes`, with
the interface `CompiledDecode` (compile_policy.py) drives, so the engine's decode-only steps
take the same path on both devices (the step's inputs built once, its new keys and values
written into the pool after it, and into the rows unless the graph stored them there,
`writes_rows`):

- The step is compiled.py's `lanes_step`, the one the CPU compiles: eager (the engine's
  default, `compile=None`: a capture costs a few steps, so every bucket is captured at its
  first decode-only step), or compiled by inductor first (`compile=True`: fused kernels, a
  compilation of minutes at the first step: not finished in 110 s at qwen2.5-0.5b on an
  H200, so its speed is unmeasured).
- Eager, the step writes each row's new key into its row and attends with one SDPA kernel
  (`lanes_step(writes=True)`: 19 ATen calls a layer of qwen2.5-0.5b instead of the
  written-out attention's 31, `benchmarks/graph_step_ops.py`), since a graph's kernels cost
  a few microseconds each however small; `fused_attention=False` keeps the written-out form
  (inductor's step always has it: it fuses it).
- One graph per bucket of rows (compiled.BUCKETS; padded rows see only their own key and
  their output is dropped), captured against the RunningKV storage as it is: its keys and
  values at their full capacity, each row's stored positions masked (`visible`). When the
  rows grow (by doubling, rows.py) the graphs are captured again, a few times in a long
  sequence's life.
- Its inputs (tokens, positions, stored lengths) are copied into the graph's own tensors;
  its logits are copied out (the next replay overwrites the graph's).
- Rows that continue a shared prefix (the n samples of a prompt where sharing pays on a GPU,
  rows.py `shares`: the prompt's keys kept once, each row only its own positions; some 16
  more kernels a layer, so only for large n x prompt) run a prefixed graph of their bucket: the
  step's prefixes (lanes.py `PrefixKV`) are copied into one static buffer when they change
  (a request joins or leaves, not every step) and each row sees its span [start, end) of it
  (two more input rows); the buffer grows to the next power of two when the prefixes outgrow
  it, and the prefixed graphs are captured again. The prefix's keys are read once a step for all rows
  that continue it, with one softmax over [its span, the row] written out.
- A capture that fails leaves the engine eager with one warning; a request never fails
  for it.

`capture=False` runs the same bookkeeping with the step called on the graph's input
tensors and its outputs copied into the same tensors each time, instead of replayed, so the
CPU's tests check everything here but the capture.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass

import torch

from decodekit.engine import compiled
from decodekit.engine.compiled import BUCKETS, bucket, lanes_step
from decodekit.models.native import NativeLM

WARMUP_RUNS = 2  # runs on a side stream before a capture: lazy initialisation (cuBLAS) is not captured


@dataclass
class _Graph:
    """One bucket's captured step: its input tensors [3, size] (tokens, positions, stored; a
    prefixed graph's [5, size]: and each row's prefix span, start and end), the RunningKV
    storage and the prefix buffer it reads, and what a replay returns."""

    inputs: torch.Tensor
    keys: torch.Tensor
    replay: object  # () -> (logits [size, V], new keys, new values [N, size, H_kv, D])
    prefix_keys: torch.Tensor | None = None


class GraphedLanes:
    """A model's decode steps on CUDA, one graph per bucket of rows (module docstring)."""

    def __init__(
        self, model: NativeLM, inductor: bool = False, capture: bool = True, fused_attention: bool = True
    ):
        self.model = model
        self.inductor = inductor
        self.capture = capture
        self.graphs: dict[tuple[int, bool], _Graph] = {}  # (rows, prefixed) -> its graph
        self.failed: str | None = None
        self.captures = 0
        # the writing step stores each row's new key and value itself: the engine then writes the pool only
        self.writes_rows = fused_attention and not inductor
        self._steps = {prefixed: lanes_step(model, "graphed_decode_step" + ("_prefixed" if prefixed else ""),
                                            prefixed, writes=self.writes_rows)
                       for prefixed in (False, True)}  # fmt: skip
        self._compiled: dict[bool, object] = {}  # the inductor-compiled steps, once compiled
        self.prefix_buffer: tuple[torch.Tensor, torch.Tensor] | None = None  # keys, values [N, 1, H_kv, P, D]
        self._copied = None  # the PrefixKV whose keys the buffer holds
        self._pool = torch.cuda.graph_pool_handle() if capture else None  # shared by the buckets' graphs

    @property
    def ready(self) -> dict[tuple[int, bool], bool]:
        """Every bucket, with and without a shared prefix: a missing graph is captured by `run`."""
        return {} if self.failed else dict.fromkeys(itertools.product(BUCKETS, (False, True)), True)

    @property
    def compiling(self) -> list[str]:
        return []

    def want(self, *args, **kwargs) -> None:
        """Nothing to ask for: `run` captures a bucket's graph when it first runs."""

    def poll(self) -> None:
        """Nothing runs between steps here."""

    def wait(self) -> None:
        """Nothing runs in the background here."""

    def end(self) -> None:
        """Nothing runs in the background here."""

    def run(self, rows: int, tokens, positions, stored, running_kv, prefix=None, bounds=None):
        """`CompiledLanes.run`'s contract: logits [rows, V], new keys/values [N, rows, H_kv,
        D], or None (the step stays eager) when a capture failed."""
        size = bucket(rows)
        if size is None or self.failed:
            return None
        running_kv.reserve_rows(size)
        prefixed = prefix is not None
        if prefixed:
            self._hold_prefix(prefix)
        graph = self.graphs.get((size, prefixed))
        if graph is None or self._stale(graph, running_kv):
            graph = self._capture_bucket(size, running_kv, prefixed)
            if graph is None:
                return None
        inputs = graph.inputs
        inputs[0, :rows].copy_(tokens)
        inputs[1, :rows].copy_(positions)
        inputs[2, :rows].copy_(stored)
        if prefixed:
            inputs[3:, :rows].copy_(bounds)
        if rows < size:
            # padded rows (unused lanes): token 0 at position 0, seeing only itself (no prefix)
            inputs[:, rows:].zero_()
        logits, keys, values = graph.replay()
        return logits[:rows].clone(), keys[:, :rows], values[:, :rows]

    def _stale(self, graph: _Graph, running_kv) -> bool:
        """Whether the rows or the prefix buffer grew since the graph was captured: it reads
        their old storage, freed memory."""
        return graph.keys is not running_kv.keys or (
            graph.prefix_keys is not None and graph.prefix_keys is not self.prefix_buffer[0])  # fmt: skip

    def _hold_prefix(self, prefix) -> None:
        """The step's prefixes (a PrefixKV) in the buffer the prefixed graphs read: copied
        when they changed, into a new buffer (the next power of two of their length, at least
        64 positions) when they do not fit."""
        if prefix is self._copied:
            return
        length = prefix.keys.shape[3]
        if self.prefix_buffer is None or self.prefix_buffer[0].shape[3] < length:
            capacity = max(64, 1 << (length - 1).bit_length())
            shape = (*prefix.keys.shape[:3], capacity, prefix.keys.shape[4])
            # zeros, not empty: positions no row sees still meet a zero weight in a matmul (0 * nan)
            self.prefix_buffer = (prefix.keys.new_zeros(shape), prefix.values.new_zeros(shape))
        self.prefix_buffer[0][:, :, :, :length].copy_(prefix.keys)
        self.prefix_buffer[1][:, :, :, :length].copy_(prefix.values)
        self._copied = prefix

    def _capture_bucket(self, size: int, running_kv, prefixed: bool) -> _Graph | None:
        for key in [key for key, graph in self.graphs.items() if self._stale(graph, running_kv)]:
            del self.graphs[key]
        try:
            prefix = self.prefix_buffer if prefixed else None
            graph = self._new_graph(size, running_kv.keys, running_kv.values, prefix)
        except Exception as error:  # noqa: BLE001 -- the engine stays eager, the request is fine
            self.failed = f"{type(error).__name__}: {error}"
            message = f"the CUDA graph of the decode step failed; the engine stays eager ({self.failed:.200})"
            warnings.warn(message, RuntimeWarning, stacklevel=4)
            return None
        self.graphs[(size, prefixed)] = graph
        self.captures += 1
        return graph

    def _new_graph(self, size: int, keys: torch.Tensor, values: torch.Tensor, prefix=None) -> _Graph:
        inputs = torch.zeros((3 if prefix is None else 5, size), dtype=torch.long, device=keys.device)
        args = (inputs[0][:, None], inputs[1], inputs[2], keys, values)
        extra = () if prefix is None else (*prefix, inputs[3:])  # the buffer and the rows' spans [2, size]
        step = self._step_function((*args, *extra), prefix is not None)
        # runs before the real inputs (a warm-up, the first outputs) read a copy of the rows:
        # the writing step would store its placeholder keys in the running sequences' rows
        scratch = (*args[:3], keys[:, :size].clone(), values[:, :size].clone(), *extra)
        args = (*args, *extra)
        prefix_keys = None if prefix is None else prefix[0]
        if not self.capture:  # as a graph: the same output tensors, overwritten by each run
            outputs = step(*scratch)

            def rerun():
                for output, new in zip(outputs, step(*args), strict=True):
                    output.copy_(new)
                return outputs

            return _Graph(inputs, keys, rerun, prefix_keys)
        device = keys.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                step(*scratch)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (another engine, a server's tokenizer)
        # does not invalidate this capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outputs = step(*args)

        def replay():
            graph.replay()
            return outputs

        return _Graph(inputs, keys, replay, prefix_keys)

    def _step_function(self, example: tuple, prefixed: bool):
        """The step a graph records: eager, or inductor's, compiled on `example` at first use."""
        if not self.inductor:
            return self._steps[prefixed]
        if prefixed not in self._compiled:
            from decodekit.engine.lanes import compile_options, compile_step

            # no C++ wrapper: a replayed graph has no wrapper to speed up
            options = compile_options(compiled.BACKEND, cpp_wrapper=False)
            name = "graphed_compiled_step" + ("_prefixed" if prefixed else "")
            step = compile_step(self.model, name, prefixed, example, compiled.BACKEND, options)
            self._compiled[prefixed] = step
        return self._compiled[prefixed]

