"""`CountCalls`: the ATen calls a piece of code dispatches, by name. On a GPU each is about one
kernel, and a replayed CUDA graph costs about its kernel count (engine/cuda_graphs.py), so
counting them on the CPU tells what a graphed step costs there
(benchmarks/graph_step_ops.py, tests/engine/test_cuda_graphs.py)."""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CountCalls(TorchDispatchMode):
    """Counts the ATen calls below it that are not views (a view launches no kernel); a cast
    counts, though `to` is declared an alias of its input (it is one when nothing changes).
    In inference mode a composite call (linear, matmul, rms_norm, SDPA) is seen once, before
    the CPU decomposes it, as CUDA runs one kernel for it."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        copied = (isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor)
                  and out.untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr())  # fmt: skip
        if not func.is_view or copied:
            self.calls[func.overloadpacket.__name__] += 1
        return out
