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
- No shared-prefix variant: on CUDA every row holds its whole sequence (rows.py: the
  prefix merge is the CPU's log-sum-exp kernel).
- A capture that fails leaves the engine eager with one warning; a request never fails
  for it.

`capture=False` runs the same bookkeeping with the step called on the graph's input
tensors and its outputs copied into the same tensors each time, instead of replayed, so the
CPU's tests check everything here but the capture.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from decodekit.engine import compiled
from decodekit.engine.compiled import BUCKETS, bucket, lanes_step
from decodekit.models.native import NativeLM

WARMUP_RUNS = 2  # runs on a side stream before a capture: lazy initialisation (cuBLAS) is not captured


@dataclass
class _Graph:
    """One bucket's captured step: its input tensors [3, size] (tokens, positions, stored),
    the RunningKV storage it reads, and what a replay returns."""

    inputs: torch.Tensor
    keys: torch.Tensor
    replay: object  # () -> (logits [size, V], new keys, new values [N, size, H_kv, D])


class GraphedLanes:
    """A model's decode steps on CUDA, one graph per bucket of rows (module docstring)."""

    def __init__(
        self, model: NativeLM, inductor: bool = False, capture: bool = True, fused_attention: bool = True
    ):
        self.model = model
        self.inductor = inductor
        self.capture = capture
        self.graphs: dict[int, _Graph] = {}
        self.failed: str | None = None
        self.captures = 0
        # the writing step stores each row's new key and value itself: the engine then writes the pool only
        self.writes_rows = fused_attention and not inductor
        self._step = lanes_step(model, "graphed_decode_step", writes=self.writes_rows)
        self._compiled = None  # the inductor-compiled step, once compiled
        self._pool = torch.cuda.graph_pool_handle() if capture else None  # shared by the buckets' graphs

    @property
    def ready(self) -> dict[tuple[int, bool], bool]:
        """Every bucket without a shared prefix: a missing graph is captured by `run`."""
        return {} if self.failed else {(size, False): True for size in BUCKETS}

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
        if size is None or prefix is not None or self.failed:
            return None
        running_kv.reserve_rows(size)
        graph = self.graphs.get(size)
        if graph is None or graph.keys is not running_kv.keys:
            graph = self._capture_bucket(size, running_kv)
            if graph is None:
                return None
        inputs = graph.inputs
        inputs[0, :rows].copy_(tokens)
        inputs[1, :rows].copy_(positions)
        inputs[2, :rows].copy_(stored)
        if rows < size:
            inputs[:, rows:].zero_()  # padded rows (unused lanes): token 0 at position 0, seeing only itself
        logits, keys, values = graph.replay()
        return logits[:rows].clone(), keys[:, :rows], values[:, :rows]

    def _capture_bucket(self, size: int, running_kv) -> _Graph | None:
        stale = [key for key, graph in self.graphs.items() if graph.keys is not running_kv.keys]
        for key in stale:  # the rows grew: graphs over their old storage read freed memory
            del self.graphs[key]
        try:
            graph = self._new_graph(size, running_kv.keys, running_kv.values)
        except Exception as error:  # noqa: BLE001 -- the engine stays eager, the request is fine
            self.failed = f"{type(error).__name__}: {error}"
            message = f"the CUDA graph of the decode step failed; the engine stays eager ({self.failed:.200})"
            warnings.warn(message, RuntimeWarning, stacklevel=4)
            return None
        self.graphs[size] = graph
        self.captures += 1
        return graph

    def _new_graph(self, size: int, keys: torch.Tensor, values: torch.Tensor) -> _Graph:
        inputs = torch.zeros((3, size), dtype=torch.long, device=keys.device)
        args = (inputs[0][:, None], inputs[1], inputs[2], keys, values)
        step = self._step_function(args)
        # runs before the real inputs (a warm-up, the first outputs) read a copy of the rows:
        # the writing step would store its placeholder keys in the running sequences' rows
        scratch = (*args[:3], keys[:, :size].clone(), values[:, :size].clone())
        if not self.capture:  # as a graph: the same output tensors, overwritten by each run
            outputs = step(*scratch)

            def rerun():
                for output, new in zip(outputs, step(*args), strict=True):
                    output.copy_(new)
                return outputs

            return _Graph(inputs, keys, rerun)
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

        return _Graph(inputs, keys, replay)

    def _step_function(self, example: tuple):
        """The step a graph records: eager, or inductor's, compiled on `example` at first use."""
        if not self.inductor:
            return self._step
        if self._compiled is None:
            from decodekit.engine.lanes import compile_options, compile_step

            # no C++ wrapper: a replayed graph has no wrapper to speed up
            options = compile_options(compiled.BACKEND, cpp_wrapper=False)
            name = "graphed_compiled_step"
            self._compiled = compile_step(self.model, name, False, example, compiled.BACKEND, options)
        return self._compiled

