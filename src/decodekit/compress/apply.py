"""Compress every `nn.Linear` of a model in place: `quantize_model` and `prune_model`.

Calibration (GPTQ, SparseGPT). The caller gives token batches [B, T] and, optionally, a
`forward(model, tokens)` callable that runs one batch through the model; the default
calls `model(tokens)` (a transformers model). A `NativeLM`, whose forward takes a cache,
passes e.g. `lambda m, t: m.forward(t, m.new_cache(t.shape[0]))`. Forward pre-hooks on
the Linear layers accumulate each layer's Hessian H = 2 X Xᵀ from its inputs.

Sequential order (as GPTQ and SparseGPT do it). Linear layers are grouped by transformer
block: the first all-digit component of the module name closes the block's prefix
("model.layers.3.mlp.up_proj" -> "model.layers.3"); a layer outside any numbered block
("lm_head") forms its own group. For each group in model order the calibration data runs
through the model with hooks on that group only, then the group is compressed; so block
i is calibrated on the outputs of the already-compressed blocks < i. Inside a block every
layer sees inputs from the block's uncompressed layers (the reference code's default,
not its "true sequential" mode). A batch stops as soon as every hooked layer has seen its
input, so block i costs a forward through blocks <= i only. `sequential=False` collects
all Hessians in one pass over the uncompressed model instead (cheaper, slightly worse).
A layer called several times in one forward (weights shared across blocks) contributes
only its first call's inputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from decodekit.compress.hessian import HessianAccumulator
from decodekit.compress.prune import parse_n_m, prune_magnitude, prune_sparsegpt
from decodekit.compress.quantize import gptq_quantize
from decodekit.models.native import embedding_dtype_device
from decodekit.models.qlinear import QuantizedEmbedding, QuantizedLinear
from decodekit.models.quant_grid import QuantSpec, quantize_rtn
from decodekit.runtime import advance_to
from decodekit.runtime import progress as progress_bar

ForwardFn = Callable[[nn.Module, torch.Tensor], Any]
# the output head (its own grid: `quantize_head`), and a mixture of experts' router and shared
# expert gate (models/feedforward.py): llama.cpp keeps ffn_gate_inp in float too
DEFAULT_SKIP = ("lm_head", "gate", "shared_expert_gate")
QUANT_METHODS = ("rtn", "gptq")
PRUNE_METHODS = ("magnitude", "sparsegpt")


@dataclass
class CompressionSummary:
    """What a compression run did; saved as JSON beside compressed checkpoints."""

    method: str
    layers: list[str] = field(default_factory=list)
    bits: int | None = None
    group_size: int | None = None
    act_order: bool = False
    activation_bits: int | None = None  # 8: the layers quantise their inputs (W8A8 / W4A8)
    sparsity: float | None = None
    n_m: tuple[int, int] | None = None
    calib_batches: int = 0
    head_bits: int | None = None  # the output head's RTN grid, one scale per channel (`quantize_head`)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_forward(model: nn.Module, tokens: torch.Tensor) -> Any:
    return model(tokens)


def find_linears(model: nn.Module, skip: Sequence[str] = DEFAULT_SKIP) -> dict[str, nn.Linear]:
    """Linear layers by module name, leaving out names with a dotted component in `skip`."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not set(name.split(".")) & set(skip)
    }


def block_prefix(name: str) -> str:
    """A module name's transformer block: its prefix up to the first numeric component, or
    the name itself outside any numbered block."""
    parts = name.split(".")
    digit = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return ".".join(parts[: digit + 1]) if digit is not None else name


def block_groups(names: Iterable[str]) -> list[list[str]]:
    """Group module names by transformer block (`block_prefix`)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(block_prefix(name), []).append(name)
    return list(groups.values())


class _StopForward(Exception):
    """Raised by a hook once every hooked layer has seen its input for this batch."""


def collect_hessians(
    model: nn.Module,
    layers: dict[str, nn.Linear],
    calib_batches: Sequence[torch.Tensor],
    forward: ForwardFn = default_forward,
    on_progress: Callable[[float], None] | None = None,
    stop_after: nn.Module | None = None,
) -> dict[str, torch.Tensor | None]:
    """H = 2 X Xᵀ [K, K] of each layer's inputs over the calibration batches [B, T];
    `on_progress`: the share of the batches done, after each. A layer no batch reached (an
    expert of a mixture no calibration token chose) gets None: compressed without data.
    `stop_after`: a module (the layers' block) past which no batch needs to run."""
    accumulators = {
        name: HessianAccumulator(layer.in_features, layer.weight.device)
        for name, layer in layers.items()
    }
    seen: set[str] = set()

    def hook_for(name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if name in seen:
                return
            accumulators[name].add(args[0])
            seen.add(name)
            if len(seen) == len(layers):
                raise _StopForward

        return hook

    def stop(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        raise _StopForward

    handles = [layer.register_forward_pre_hook(hook_for(name)) for name, layer in layers.items()]
    if stop_after is not None:
        handles.append(stop_after.register_forward_hook(stop))
    try:
        with torch.no_grad():
            for i, tokens in enumerate(calib_batches):
                seen.clear()
                with contextlib.suppress(_StopForward):
                    forward(model, tokens)
                if on_progress is not None:
                    on_progress((i + 1) / len(calib_batches))
    finally:
        for handle in handles:
            handle.remove()
    return {name: acc.hessian if acc.count else None for name, acc in accumulators.items()}


def quantize_head(
    model: nn.Module, bits: int, name: str = "lm_head", embedding: str = "embed_tokens"
) -> None:
    """The output head RTN-quantised to `bits`, one scale per output channel, in place. A real
    vocabulary makes it a small model's largest matrix (Qwen2.5's 151,936 x 896: 40 ms a token
    read in float32 on a Zen 4, 5.6 ms in int8). A tied embedding (the same weight) then looks
    its rows up on the head's grid (`QuantizedEmbedding`, as a GGUF's tied q8_0 embedding, and
    as llama.cpp reads it): the vocabulary is held once, in its codes, not beside them in float
    (545 MB at Qwen2.5's in float32), and the rows the model reads are the head's values."""
    head = model.get_submodule(name)
    if not isinstance(head, nn.Linear):
        raise ValueError(f"the output head {name!r} is a {type(head).__name__}, not a float Linear")
    lookup = getattr(model, embedding, None)
    tied = lookup is not None and getattr(lookup, "weight", None) is head.weight
    grid = QuantizedLinear.from_linear(head, QuantSpec(bits))
    replace_module(model, name, grid)
    if tied:  # an nn.Embedding, or a HalfEmbedding (models/half_linear.py): the rows' dtype
        replace_module(model, embedding, QuantizedEmbedding(grid, embedding_dtype_device(lookup)[0]))


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _compress_layers(
    model: nn.Module,
    layers: dict[str, nn.Linear],
    needs_calibration: bool,
    calib_batches: Sequence[torch.Tensor] | None,
    forward: ForwardFn | None,
    sequential: bool,
    compress_one: Callable[[str, nn.Linear, torch.Tensor | None], None],
    progress: bool = False,
) -> None:
    """Run `compress_one(name, layer, hessian)` on every layer, calibrating group by group;
    `progress` shows a bar over the layers on stderr."""
    if needs_calibration and not calib_batches:
        raise ValueError(
            "this method needs calibration data: pass calib_batches (token tensors [B, T])"
        )
    with progress_bar(total=len(layers), desc="compress", enabled=progress) as bar:
        if not needs_calibration:
            for name, layer in layers.items():
                bar.set_postfix_str(name, refresh=False)
                compress_one(name, layer, None)
                bar.update()
            return
        groups = block_groups(layers) if sequential else [list(layers)]
        for group in groups:
            group_layers = {name: layers[name] for name in group}
            start = bar.n
            # the calibration forwards (40 s a block for the shipped model on a loaded machine,
            # issue 35) move the bar within the group's first layer
            # the group's block: past it no batch needs to run, though an expert it holds was
            # not chosen
            block = model.get_submodule(block_prefix(group[0])) if sequential else None
            hessians = collect_hessians(model, group_layers, calib_batches, forward or default_forward,
                                        on_progress=lambda share, at=start: advance_to(bar, at + 0.9 * share),
                                        stop_after=block)
            for i, name in enumerate(group):
                bar.set_postfix_str(name, refresh=False)
                compress_one(name, layers[name], hessians.pop(name))
                advance_to(bar, start + i + 1)


def quantize_model(
    model: nn.Module,
    method: str = "rtn",
    bits: int = 8,
    group_size: int | None = None,
    calib_batches: Sequence[torch.Tensor] | None = None,
    forward: ForwardFn | None = None,
    skip: Sequence[str] = DEFAULT_SKIP,
    act_order: bool = False,
    block_size: int = 128,
    damp: float = 0.01,
    sequential: bool = True,
    progress: bool = False,
    activation_bits: int | None = None,
) -> CompressionSummary:
    """Replace every Linear (except `skip`) by a `QuantizedLinear`, in place; with
    `activation_bits` 8 the layers quantise their inputs too (models/qlinear.py, W8A8/W4A8).

    method "rtn": absmax round-to-nearest; "gptq": GPTQ on calibration batches [B, T]
    run through `forward(model, tokens)` (module docstring). Layers whose in_features the
    group size does not divide are left in float and not listed in the summary. `progress`
    shows a bar over the layers on stderr.
    """
    if method not in QUANT_METHODS:
        raise ValueError(f"method must be one of {QUANT_METHODS}, got {method!r}")
    spec = QuantSpec(bits, group_size, activation_bits)
    layers = {
        name: layer
        for name, layer in find_linears(model, skip).items()
        if group_size is None or layer.in_features % group_size == 0
    }
    summary = CompressionSummary(
        method, bits=bits, group_size=group_size, act_order=act_order and method == "gptq",
        activation_bits=activation_bits,
    )

    def compress_one(name: str, layer: nn.Linear, hessian: torch.Tensor | None) -> None:
        if hessian is None:
            codes, scales = quantize_rtn(layer.weight, spec)
        else:
            codes, scales = gptq_quantize(layer.weight, hessian, spec, block_size, damp, act_order)
        replace_module(model, name, QuantizedLinear.from_linear(layer, spec, codes, scales))
        summary.layers.append(name)

    _compress_layers(
        model, layers, method == "gptq", calib_batches, forward, sequential, compress_one, progress
    )
    summary.calib_batches = len(calib_batches) if method == "gptq" and calib_batches else 0
    return summary


def prune_model(
    model: nn.Module,
    method: str = "magnitude",
    sparsity: float = 0.5,
    n_m: str | tuple[int, int] | None = None,
    calib_batches: Sequence[torch.Tensor] | None = None,
    forward: ForwardFn | None = None,
    skip: Sequence[str] = DEFAULT_SKIP,
    block_size: int = 128,
    damp: float = 0.01,
    sequential: bool = True,
    progress: bool = False,
) -> CompressionSummary:
    """Prune every Linear (except `skip`) in place; the layers stay `nn.Linear` with zeros.

    method "magnitude" or "sparsegpt" (needs calibration batches, module docstring);
    `n_m` ("2:4") gives n zeros in every m weights and then `sparsity` is unused. With
    n_m, layers whose in_features m does not divide are left dense and not listed.
    `progress` shows a bar over the layers on stderr.
    """
    if method not in PRUNE_METHODS:
        raise ValueError(f"method must be one of {PRUNE_METHODS}, got {method!r}")
    nm = parse_n_m(n_m) if n_m is not None else None
    layers = {
        name: layer
        for name, layer in find_linears(model, skip).items()
        if nm is None or layer.in_features % nm[1] == 0
    }
    summary = CompressionSummary(method, sparsity=None if nm else sparsity, n_m=nm)

    def compress_one(name: str, layer: nn.Linear, hessian: torch.Tensor | None) -> None:
        if hessian is None:
            pruned = prune_magnitude(layer.weight.detach(), sparsity, nm)
        else:
            pruned = prune_sparsegpt(layer.weight, hessian, sparsity, nm, block_size, damp)
        with torch.no_grad():
            layer.weight.copy_(pruned.to(layer.weight.dtype))
        summary.layers.append(name)

    _compress_layers(
        model, layers, method == "sparsegpt", calib_batches, forward, sequential, compress_one,
        progress,
    )
    summary.calib_batches = len(calib_batches) if method == "sparsegpt" and calib_batches else 0
    return summary


def model_nbytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters and buffers (shared tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total
