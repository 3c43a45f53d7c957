"""Device checks a CPU-only machine can run (issue 33; docs/ARCHITECTURE.md, "Devices and
processes").

`NamedDevices`: a `TorchFunctionMode` under which a tensor factory called from decodekit's
own code (src/decodekit) without a `device` raises `UnnamedDevice`, naming the file and line.
On a CPU such a tensor lands beside the model by luck; on a GPU it is a CPU tensor that
meets the model's (a crash: `index_select` with a CPU index, a CPU draft compared with a
CUDA argmax) or is copied to it on every step. It acts as a default device foreign to every
model ("meta" would do the same, later and with a vaguer error): the factory either names
the model's device (`device=x.device`) or the CPU explicitly, for host bookkeeping.
Factories called from other libraries (transformers, torch's own Python) are theirs.

`HostReads`: counts, per call site in decodekit, the operations that read a tensor's values
on the host (`.item()`, `.tolist()`, `bool()`/`int()`/`float()` of a tensor, `.cpu()`,
`.numpy()`, `nonzero`): each is a device synchronisation when the tensor lives on a GPU. On
the CPU it also counts reads of tensors that are host bookkeeping there as well (a CPU
generator's uniforms), so its count bounds a GPU's from above.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

import decodekit

PACKAGE = str(Path(decodekit.__file__).parent)
TORCH = str(Path(torch.__file__).parent)
FACTORIES = frozenset(_device_constructors())


class UnnamedDevice(AssertionError):
    """A tensor factory in decodekit without a device."""


def decodekit_caller() -> str | None:
    """'path:line' of the innermost frame outside torch and this module, if it is in
    decodekit's package; None for any other caller."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(TORCH)
                                 or frame.f_code.co_filename == __file__):  # fmt: skip
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(PACKAGE):
        return None
    return f"{frame.f_code.co_filename[len(PACKAGE) - len('decodekit'):]}:{frame.f_lineno}"


class NamedDevices(TorchFunctionMode):
    """Every tensor factory decodekit calls names its device (module docstring). raises:
    False collects the call sites in `unnamed` instead (to list them all at once)."""

    def __init__(self, raises: bool = True):
        super().__init__()
        self.raises = raises
        self.unnamed: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in FACTORIES and kwargs.get("device") is None and not torch.compiler.is_compiling()
                and not _keeps_a_tensor(func, args)):  # fmt: skip
            where = decodekit_caller()
            if where is not None and self.raises:
                raise UnnamedDevice(f"torch.{func.__name__} at {where} names no device: pass the model's "
                                    "(device=x.device) or device='cpu' for host bookkeeping")  # fmt: skip
            if where is not None:
                self.unnamed[f"{where} ({func.__name__})"] += 1
        return func(*args, **kwargs)


def _keeps_a_tensor(func, args) -> bool:
    """torch.as_tensor(t) / asarray(t) of a tensor: it stays on its device."""
    return func in (torch.as_tensor, torch.asarray) and bool(args) and isinstance(args[0], torch.Tensor)


_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy,
          torch.Tensor.nonzero, torch.nonzero}  # fmt: skip


class HostReads(TorchFunctionMode):
    """Counts host reads of tensor values by decodekit's code (module docstring); `.to("cpu")`
    as well. `counts`: 'path:line (op)' -> calls."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS or (func is torch.Tensor.to and _to_cpu(args, kwargs)):
            where = decodekit_caller()
            if where is not None:
                self.counts[f"{where} ({func.__name__})"] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _to_cpu(args, kwargs) -> bool:
    """`.to("cpu")` spelt so (on a CPU run `.to(x.device)` is the same call, but an upload)."""
    return kwargs.get("device", args[1] if len(args) > 1 else None) == "cpu"
