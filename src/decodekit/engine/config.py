"""`EngineConfig`: the engine's memory bound and batch limits, validated on construction.

Per-request choices stay in `SamplingParams`; this is the machine-side configuration
(STYLE.md, rule 5). The KV memory bound is either a number of blocks or a number of
bytes; the engine turns bytes into blocks for its model (`num_blocks_for`). Unset, the
bound is the device's (`kv_bytes_for`): 256 MiB on the CPU, and on a GPU 40 % of the memory
free when the pool is built (vLLM likewise sizes its cache from the GPU's memory,
`gpu_memory_utilization`), since the pool only grows to the bound as sequences need it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decodekit.validate import check_int

CPU_KV_BYTES = 256 * 2**20
# The share of a GPU's free memory an unset bound lets the pool grow to: the running
# sequences' dense rows (rows.py) can hold as much again, and a step's activations and
# logits need the rest.
GPU_KV_SHARE = 0.4

KV_DTYPES = ("float32", "bfloat16", "float16", "int8")


@dataclass(frozen=True)
class EngineConfig:
    """block_size: positions per KV block (vLLM's default is 16).
    num_blocks / max_kv_bytes: the bound of the KV block pool (blocks win when both are
    set; neither: the device's, `kv_bytes_for`). The decoding sequences' dense rows (rows.py)
    come on top of it: at most max_running x the longest running sequence x the bytes of one
    position.
    max_running: sequences decoded together in one forward.
    max_waiting: requests queued before `submit` raises `EngineFull`.
    max_prefill_tokens: prompt tokens admitted per step (a request longer than this is
    still admitted alone, so it cannot starve).
    prefix_caching: keep the KV of full blocks for later requests with the same prefix.
    compile: the compiled decode step for the decoding rows (engine/compiled.py), and on the
    CPU for a member model's one-token forwards and for steps that only verify speculative
    spans: None compiles a batch bucket of up to 8 rows in the background once the steps so
    far would have repaid its measured warm-up, True every bucket on its first step, False
    never. On a GPU (engine/cuda_graphs.py): None and True replay every bucket's
    step from a CUDA graph captured at its first decode step (True compiles the step with
    inductor first), False runs it eager.
    kv_dtype: the dtype the block pool stores KV in (None: the model's); "int8" keeps a
    float32 scale per layer, head and position (engine/block_pool.py). The running rows stay in the
    model's dtype (rows.py), so it shrinks the pool, not the rows.
    idle_member_bytes: the KV storage kept for member pools (drafts, amateurs: program.py)
    that no queued or running program uses, so a later request with the same draft reuses
    its prefix cache; beyond it the least recently used are freed (0: a member's pool is
    freed as soon as its last program ends).
    """

    block_size: int = 16
    num_blocks: int | None = None
    max_kv_bytes: int | None = None
    max_running: int = 64
    max_waiting: int = 1024
    max_prefill_tokens: int = 4096
    prefix_caching: bool = True
    compile: bool | None = None
    kv_dtype: str | None = None
    idle_member_bytes: int = 64 * 2**20

    def __post_init__(self):
        for name in ("block_size", "max_running", "max_waiting", "max_prefill_tokens"):
            check_int(name, getattr(self, name), 1)
        if self.num_blocks is not None:
            check_int("num_blocks", self.num_blocks, 1)
        if self.max_kv_bytes is not None:
            check_int("max_kv_bytes", self.max_kv_bytes, 1)
        check_int("idle_member_bytes", self.idle_member_bytes, 0)
        if self.compile not in (None, True, False):
            raise ValueError(f"compile must be True, False or None (automatic), got {self.compile!r}")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)} or None, got {self.kv_dtype!r}")

    def num_blocks_for(self, bytes_per_block: int, device: str | torch.device = "cpu") -> int:
        """Blocks that fit the bound on `device`, given one block's K and V bytes over all
        layers."""
        if self.num_blocks is not None:
            return self.num_blocks
        bound = self.kv_bytes_for(device)
        blocks = bound // bytes_per_block
        if blocks < 1:
            raise ValueError(f"max_kv_bytes ({bound}) must hold at least one block of {bytes_per_block} "
                             "bytes")
        return blocks

    def blocks_holding(self, sequences: int, positions: int) -> int:
        """Blocks that hold `sequences` sequences of up to `positions` positions each running
        at once, each with its partial block."""
        return sequences * (-(-positions // self.block_size) + 1)

    def kv_bytes_for(self, device: str | torch.device = "cpu") -> int:
        """The pool's bound in bytes: `max_kv_bytes`, or unset the device's (module docstring)."""
        if self.max_kv_bytes is not None:
            return self.max_kv_bytes
        device = torch.device(device)
        if device.type != "cuda":
            return CPU_KV_BYTES
        free, _ = torch.cuda.mem_get_info(device)
        return max(CPU_KV_BYTES, int(GPU_KV_SHARE * free))
