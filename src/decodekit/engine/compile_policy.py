"""When the engine's decode-only steps run compiled: the compile policy.

`eligible` says whether an engine can use the compiled step at all. `CompilePolicy` says when
a bucket is worth compiling (compiled.py's docstring: a bucket compiles once the decode-only
steps already run would have repaid its warm-up, measured and remembered on disk).
`CompiledDecode` is the engine's side: it runs a decode-only step through its bucket when
that is ready, and times the eager ones, the policy's evidence.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from decodekit.cache_dir import cache_dir
from decodekit.engine.batch import to_device
from decodekit.engine.compiled import ASSUMED_SAVING, AUTO_MAX_ROWS, COLD_WARMUP_S, bucket, bucket_name
from decodekit.engine.cuda_graphs import GraphedLanes
from decodekit.engine.lanes import PrefixKV, lanes_for
from decodekit.engine.rows import GatheredRows
from decodekit.models.native import NativeLM

_log = logging.getLogger(__name__)


def eligible(model, pool, batch_invariant: bool) -> str | None:
    """Why this engine cannot use the compiled step, or None if it can."""
    if not isinstance(model, NativeLM):
        return f"{type(model).__name__} is not a NativeLM"
    if batch_invariant:
        return "the batch-invariant mode attends per query"
    if pool.keys.dtype != model.dtype:
        return f"the KV pool stores {pool.keys.dtype}, not the model's {model.dtype}"
    if model.config.num_experts:
        return "a mixture of experts picks its experts on the host (models/feedforward.py)"
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
    def for_model(cls, model: NativeLM, mode: bool | None, span: int = 1) -> CompilePolicy:
        key = shape_key(model) + ("" if span == 1 else f"/verify{span}")
        policy = cls(mode, cache_dir() / "compile-times.json", key)
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


class CompiledDecode:
    """An engine's compiled decode steps (lanes.py) and the evidence of its eager ones."""

    def __init__(self, model: NativeLM, mode: bool | None, span: int = 1):
        if model.device.type == "cuda":  # CUDA graphs, captured at once; inductor's step with True
            assert span == 1, "verification steps compile on the CPU only (CompiledSpans)"
            self.lanes = GraphedLanes(model, inductor=mode is True)
        else:
            self.lanes = lanes_for(model, span)
        self.policy = CompilePolicy.for_model(model, mode, span)
        self.span = span  # tokens a row: 1 decodes, T > 1 verifies (`_verify`)
        self.decode_steps = 0  # eager decode-only steps (the policy's evidence) and their mean time
        self.eager_step_s = 0.0
        self.steps = 0
        self.prefix_kv: PrefixKV | None = None  # the shared prefixes the last compiled step read
        # dynamic NTK or LongRoPE: the compiled steps hold the tables below the switch
        # (compiled.py `lanes_step`), so a step with a row past it runs eager
        self.threshold = model.config.rope.threshold

    def forward(self, works: list, running_kv, pool, eager: Callable[[], tuple]) -> tuple:
        """Logits [B, V] of a decode-only step's rows (scheduler.py `Work`, in lane order)
        and None for the hidden states: through the compiled step when its bucket is ready
        (their new keys and values written into the rows and the pool), else `eager()`,
        timed for the policy."""
        logits = self._compiled(works, running_kv, pool)
        if logits is not None:
            return logits, None
        start = time.perf_counter()
        out = eager()
        seconds = time.perf_counter() - start
        self.decode_steps += 1
        self.eager_step_s += (seconds - self.eager_step_s) / self.decode_steps
        prefixed = any(prefix is not None for prefix in running_kv.prefixes)
        self.lanes.want(len(works), self.policy, self.decode_steps, self.eager_step_s, running_kv,
                        prefixed=prefixed)  # fmt: skip
        return out

    def _compiled(self, works: list, running_kv, pool) -> torch.Tensor | None:
        threshold = self.threshold
        if threshold is not None and any(work.seq.table.length > threshold for work in works):
            return None  # a row past its RoPE's switch: its tables are its length's (eager, batch.py)
        if self.span > 1:
            return self._verify(works, running_kv, pool)
        self.prefix_kv = prefix = PrefixKV.for_rows(running_kv.prefixes, self.prefix_kv)
        seqs = [work.seq for work in works]
        if (bucket(len(seqs)), prefix is not None) not in self.lanes.ready:
            return None  # not compiled (yet): no inputs to build
        device = running_kv.keys.device  # the step's indices live beside the rows they index
        # each row's token, its position, the positions its row holds before it and its
        # pool slot, [4, B], and the rows' prefix spans [2, B]: one copy to the device
        per_row = [[seq.tokens[seq.table.length - 1] for seq in seqs],
                   [seq.table.length - 1 for seq in seqs],
                   [length - 1 for length in running_kv.lengths],
                   [work.slots[0] for work in works]]  # fmt: skip
        if prefix is not None:
            per_row += prefix.bounds(running_kv.prefixes)
        tokens, positions, stored, slots, *spans = to_device(per_row, device).unbind()
        bounds = None if prefix is None else torch.stack(spans)
        out = self.lanes.run(len(seqs), tokens, positions, stored, running_kv, prefix, bounds)
        if out is None:
            return None
        logits, keys, values = out  # [B, V], [N, B, H_kv, D]
        if not self.lanes.writes_rows:  # a writing graph stored them in the rows (cuda_graphs.py)
            rows = torch.arange(len(seqs), device=device)
            running_kv.keys[:, rows, :, stored] = keys.transpose(0, 1)  # [B, N, H_kv, D]
            running_kv.values[:, rows, :, stored] = values.transpose(0, 1)
        pool.write_layers(slots, keys.transpose(1, 2), values.transpose(1, 2))  # [N, H_kv, B, D]
        self.steps += 1
        return logits

    def _verify(self, works: list, rows: GatheredRows, pool) -> torch.Tensor | None:
        """Logits [B * T, V] of a verification step, every row's T tokens in order (their new
        keys and values written into the pool), or None while its bucket is not ready."""
        span, seqs = self.span, [work.seq for work in works]
        if (bucket(len(seqs)), False) not in self.lanes.ready:
            return None
        count = len(seqs) * span
        # each row's T tokens and positions, the positions it holds before them, their slots:
        # one copy to the device
        flat = [t for seq in seqs for t in seq.tokens[seq.table.length - span : seq.table.length]]
        flat += [p for seq in seqs for p in range(seq.table.length - span, seq.table.length)]
        flat += [seq.table.length - span for seq in seqs]
        flat += [slot for work in works for slot in work.slots]
        indices = to_device(flat, pool.keys.device)
        tokens, positions, stored, slots = indices.split([count, count, len(seqs), count])
        out = self.lanes.run(len(seqs), tokens.view(-1, span), positions.view(-1, span), stored, rows)
        if out is None:
            return None
        logits, keys, values = out  # [B, T, V], [N, B, T, H_kv, D]
        layers, _, _, kv_heads, dim = keys.shape
        pool.write_layers(slots, keys.permute(0, 3, 1, 2, 4).reshape(layers, kv_heads, count, dim),
                          values.permute(0, 3, 1, 2, 4).reshape(layers, kv_heads, count, dim))  # fmt: skip
        self.steps += 1
        return logits.reshape(count, -1)


# Verification spans compiled per T up to this: γ <= 16 and the block's extra token.
MAX_SPAN = 17


class CompiledSpans:
    """An engine's compiled verification steps, one `CompiledDecode` per span T: a step whose
    every sequence feeds the same T > 1 tokens and keeps the logits of each (speculative
    verification; no lanes, no sampling rows) runs T's bucket over rows gathered from the pool
    (rows.py `GatheredRows`), under the engine's compile mode. On the CPU only: a CUDA graph
    replays fixed storage, and gathered rows are new tensors every step."""

    def __init__(self, model: NativeLM, mode: bool | None):
        self.model, self.mode = model, mode
        self.by_span: dict[int, CompiledDecode] = {}

    @staticmethod
    def verifies(works: list) -> bool:
        """Whether a step's works (scheduler.py `Work`) are all verification spans of one T."""
        span = works[0].count if works else 0
        return 1 < span <= MAX_SPAN and all(w.every and w.count == span and w.seq.lane is None for w in works)

    def forward(self, works: list, pool, eager: Callable[[], tuple]) -> tuple:
        """(logits [B * T, V], None) of a verification step (`verifies`): compiled when T's
        bucket is ready, else `eager()`."""
        span = works[0].count
        step = self.by_span.get(span)
        if step is None:
            step = self.by_span[span] = CompiledDecode(self.model, self.mode, span)
        tables = [work.seq.table for work in works]
        rows = GatheredRows(pool, [table.blocks for table in tables], [table.length for table in tables])
        return step.forward(works, rows, pool, eager)

    def poll(self) -> None:
        """Between steps: the buckets that are due compile (lanes.py `poll`)."""
        for step in self.by_span.values():
            step.lanes.poll()
