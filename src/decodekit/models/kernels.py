"""decodekit's native CPU kernels (csrc/): GEMVs, y = x Wᵀ for a few rows (issue 23), and RMSNorm.

Batch-1 decode is a matrix-vector product bound by memory bandwidth; PyTorch's CPU ops read
float32 weights at ~2/3 of what one core can stream and have no kernel for grouped int8 at
all (REFERENCES.md, "CPU peers and kernels"). The extension registers three ops under the
`decodekit` namespace (TORCH_LIBRARY, so they dispatch like any aten op), each taking x
[..., K] and returning [..., N]:

- `linear(x, w, bias)`: a float weight [N, K] in either layout below (`float_linear`);
- `linear_t(x, wt, bias)`: float32 (or bfloat16, float16) weights in the transposed layout
  models/native.py keeps for float32 (`transpose_weight_layout`), wt [K, N] contiguous;
- `linear_gemm(x, w, bias)` (csrc/gemm.cpp): float32 w [N, K] in that transposed layout, a
  register-blocked GEMM for 2 to 8,192 rows with linear_t's sums (batched decode, prefill);
- `linear_rows(x, w, scales, group, bias)`: row-major w [N, K] of float32, bfloat16,
  float16 or int8, with optional float32 scales [N, K / group]; x is read in float32, so
  float and int8 weights compute in float32 (weight-only: the same numbers as dequantising),
  except bfloat16 x with bfloat16 weights (a bfloat16 model) on AVX-512 BF16: exact products by
  vdpbf16ps, f32 sums in its rounding (denormals flushed);
- `linear_int4(x, w, scales, group, bias)` (csrc/gemv_int4.cpp): int4 codes repacked by
  `pack_int4_blocks`, x rounded to bfloat16 (as qlinear.py's int4pack path), float32 sums
  (AVX-512 BF16: vdpbf16ps; AVX2: codes + 8 masked in place against pre-scaled x, the + 8
  taken off per group, the same value up to float32 rounding);
- `linear_w8a8(x, w, scales, bias)`, `linear_w4a8(x, w, scales, bias)` (csrc/gemv_a8.cpp):
  activation-quantised, for layers that opted in (`activation_bits=8`): x quantised per block
  of 32 inputs to int8 with one scale each (llama.cpp's q8_0), int8 / int4 codes repacked by
  `pack_a8_blocks`, integer dot products per block (AVX-512 VNNI, or AVX2), float32 sums over
  blocks; scales [N, 1] or one per block of 32 inputs. They serve any number of rows (the
  layers' prefills too: W8A8 on AVX2 from 16 rows on csrc/gemm_a8.cpp's register-blocked
  tiles), and a row's outputs have the same bits whatever the rows beside it;
- `dequantize(codes, scales, in_features, out)` (csrc/dequant.cpp): a quantised layer's
  weight written into `out` (float32 or bfloat16) for the one GEMM of its prefill (`dequantize`);
- `rms_norm(x, weight, eps)` (csrc/norm.cpp): float32 RMSNorm over the last dimension, one op
  where ATen runs six (models/native.py's eager CPU path; `eager_op` says when it may run);
- `row_logsumexp(x)` (csrc/logsumexp.cpp): each float32 row's logsumexp without writing the
  row, the normaliser of a sampled token's raw logprob (sampling/select.py `chosen_logprobs`).

Each kernel decodes a block of 4 weight rows once for up to 4 input rows at a time, so a few
rows (batched decoding, a speculative verification span) cost far less than that many
single-row calls.

The library is built once per source, torch version and CPU, at first use or by
`python -m decodekit.models.kernels --build` (scripts/setup.sh runs it), and found again by
every later process (models/kernel_build.py: where, the lock, the failures remembered).
Without it (no compiler, a failed build, a CPU without AVX2 + FMA, or DECODEKIT_KERNELS=0)
every caller runs its pure-torch path; `status()` says which and why.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from decodekit.models import kernel_build
from decodekit.scratch import scratch as thread_scratch

DISABLE_ENV = "DECODEKIT_KERNELS"  # "0" disables the kernels (the pure-torch paths run)
ISA_NAMES = {1: "avx2", 2: "avx512"}
# Rows up to which the float kernels beat PyTorch's GEMM paths (BENCHMARKS.md, 2026-11-24, round 2:
# at 8 rows f32 1,231 against 1,685 us, bf16 394 against 635; at 12 bf16 is even).
GEMV_MAX_ROWS = 8
# float32 x over half weights (half_linear.py `keep_half_weights`): rows up to which the rows
# kernel beats widening the weight for one float32 GEMM, per instruction set. 896 -> 4864 on a
# Zen 4, one thread (BENCHMARKS.md, 2026-11-29): with AVX-512 at every count measured, 1-512
# rows (within 8 % of the float32 model's GEMM from 256), with AVX2 at 8-64, widening from ~256.
HALF_WEIGHT_MAX_ROWS = {"avx512": 8192, "avx2": 128}
# Float32 weights in the transposed layout run the GEMM of csrc/gemm.cpp from GEMM_MIN_ROWS rows
# of the instruction set in use, where it catches up with linear_t's axpy kernel (the same sums,
# so the switch changes no bit), up to 8,192 rows, the most measured. AVX-512 (Zen 5): from 2
# rows, 2-2.5x PyTorch's sgemm from 8 to 8,192 rows (BENCHMARKS.md, "Small-M float32 GEMM",
# 2026-11-25). AVX2 (Zen 3, 2026-11-28, "A speculative verification's rows on AVX2"): its 4 x 3
# tile reads each row of wt in 96-byte pieces, which stream from memory at half linear_t's speed,
# so a large matrix (`LARGE_MATRIX` elements or more: a model past the cache streams it) runs
# linear_t up to 32 rows (1.4-2.2x the GEMM at 2-16 rows); a small one, read from the cache, the
# GEMM from 8 (up to 1.3x linear_t at 8-32 rows). Pairs: (small matrix, large matrix).
GEMM_MIN_ROWS = {"avx512": (2, 2), "avx2": (8, 32)}
LARGE_MATRIX = 1 << 18  # elements: 1 MiB of float32
GEMM_MAX_ROWS = 8192
# The loaded ISA's pair (`status` sets it): a module global, which a traced graph reads as a constant.
_gemm_from = GEMM_MIN_ROWS["avx512"]
_half_weight_rows = HALF_WEIGHT_MAX_ROWS["avx512"]
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Status:
    """Whether the kernels run here, and a one-line reason when they do not."""

    available: bool
    reason: str  # the instruction set in use, or why the pure-torch paths run
    library: Path | None  # the library loaded, or where it would be built (None: not known)


@functools.cache
def status(build: bool = True) -> Status:
    """Load the library once per process, building it first when none was built for this
    source, torch and CPU and no earlier build failed (`build=False`: never build, for a
    report). Never raises: whatever stops the kernels is the reason."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return Status(False, f"disabled by {DISABLE_ENV}=0", None)
    try:
        path = kernel_build.ensure() if build else kernel_build.find()
        if path is None:
            target = kernel_build.build_dir() / kernel_build.library_name()
            failure = kernel_build.remembered_failure(target)
            why = f"an earlier build failed ({failure})" if failure else "not built yet"
            return Status(False, f"{why}; `python -m decodekit.models.kernels --build` builds it", target)
    except (kernel_build.BuildError, OSError) as error:
        return Status(False, str(error), None)
    try:
        if not hasattr(torch.ops.decodekit, "isa"):
            torch.ops.load_library(str(path))
        level = torch.ops.decodekit.isa()
    except (OSError, RuntimeError) as error:
        return Status(False, f"failed to load {path.name}: {error}", path)
    if level not in ISA_NAMES:
        return Status(False, "this CPU lacks AVX2 + FMA", path)
    global _gemm_from, _half_weight_rows
    _gemm_from = GEMM_MIN_ROWS[ISA_NAMES[level]]
    _half_weight_rows = HALF_WEIGHT_MAX_ROWS[ISA_NAMES[level]]
    return Status(True, ISA_NAMES[level], path)


def available() -> bool:
    return status().available


_TRACEABLE = False  # set by `register_fakes`; a module global, so a traced graph reads a constant


@functools.cache
def register_fakes() -> None:
    """Shape functions of the ops, so that `torch.compile` can trace graphs that call them
    (engine/compiled.py): each returns x's dtype, [..., N]."""
    global _TRACEABLE
    if not available():
        return

    def out(x: torch.Tensor, n: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], n))

    torch.library.register_fake("decodekit::linear")(lambda x, w, bias: out(x, w.shape[0]))
    torch.library.register_fake("decodekit::linear_t")(lambda x, wt, bias: out(x, wt.shape[1]))
    torch.library.register_fake("decodekit::linear_gemm")(lambda x, w, bias: out(x, w.shape[0]))
    torch.library.register_fake("decodekit::linear_rows")(
        lambda x, w, scales, group, bias: out(x, w.shape[0])
    )
    torch.library.register_fake("decodekit::linear_int4")(
        lambda x, w, scales, group, bias: out(x, scales.shape[0])
    )
    for op in ("decodekit::linear_w8a8", "decodekit::linear_w4a8"):
        torch.library.register_fake(op)(lambda x, w, scales, bias: out(x, scales.shape[0]))
    _TRACEABLE = True


def eager_op(*tensors: torch.Tensor) -> bool:
    """Whether an eager forward may call one of the ops that have no autograd formula and no
    fake kernel (`rms_norm`) on these CPU tensors: the kernels run, nothing is being traced,
    and no gradient would flow through them."""
    return no_grad_needed(*tensors) and available()


def no_grad_needed(*tensors: torch.Tensor) -> bool:
    """Nothing is being traced and no gradient would flow through these tensors (so a result
    may be computed outside autograd, or from a reused `scratch` buffer)."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def traceable() -> bool:
    """Whether a graph being compiled may call the ops (`register_fakes` has run); read while
    tracing instead of `available`, whose first call loads the library."""
    return _TRACEABLE


def max_rows(dtype: torch.dtype, x_dtype: torch.dtype | None = None) -> int:
    """Rows of x up to which `float_linear` beats PyTorch's GEMM for weights of `dtype` (and
    float32 x over half weights: the widened GEMM)."""
    if dtype == torch.float32:
        return GEMM_MAX_ROWS
    return _half_weight_rows if x_dtype == torch.float32 else GEMV_MAX_ROWS


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] Wᵀ + b for a float weight [N, K] (float32 in either layout, bfloat16 or
    float16 row-major) on the kernels: one op call (`decodekit::linear` picks the layout and
    reshapes in C++, no Python-side view per call). From `GEMM_MIN_ROWS` rows (per instruction
    set and matrix size), float32 in the transposed layout (weight.stride(0) == 1) runs
    `decodekit::linear_gemm`, whose sums equal linear_t's: a row's outputs have the same bits
    whatever the rows in the call."""
    rows = _gemm_from[weight.numel() >= LARGE_MATRIX]
    if x.numel() >= rows * x.shape[-1] and weight.dtype == torch.float32 and weight.stride(0) == 1:
        return torch.ops.decodekit.linear_gemm(x, weight, bias)
    return torch.ops.decodekit.linear(x, weight, bias)


def scratch(rows: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
    """A CPU [rows, columns] buffer this thread reuses, valid until its next call: a prefill's
    weight made for one GEMM (`dequantize`, models/native.py `widened_linear`). A fresh one of
    a large layer's size was page-faulted in on every call: 4.6 ms to allocate and fill 17 MB
    against 1.1 ms to refill (Zen 3). It keeps the largest such weight per dtype and thread that
    prefilled, memory each call allocated and freed before (decodekit/scratch.py). Callers use
    it at once and never where autograd would save it (`eager_op`, `no_grad_needed`)."""
    return thread_scratch((rows, columns), dtype, "widened weight")


def dequantize(codes: torch.Tensor, scales: torch.Tensor, in_features: int,
               dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """A quantised layer's weight [N, K] in float32 or bfloat16 for one prefill GEMM
    (`decodekit::dequantize`, csrc/dequant.cpp: quant_grid.dequantize's bits in one pass), from
    int8 codes [N, K] or int4 ones packed two a byte (quant_grid.pack_int4), written into this
    thread's `scratch`."""
    out = scratch(codes.shape[0], in_features, dtype)
    torch.ops.decodekit.dequantize(codes, scales, in_features, out)
    return out


def dequantize_blocks(blocks: torch.Tensor, scales: torch.Tensor, in_features: int,
                      dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """`dequantize` of an int4 layer's weight from the GEMV kernel's layout (`pack_int4_blocks`),
    which is all an int4 layer keeps of its codes (qlinear.py); [N, K] into this thread's scratch."""
    out = scratch(scales.shape[0], in_features, dtype)
    torch.ops.decodekit.dequantize_blocks(blocks, scales, in_features, out)
    return out


def unpack_int4_blocks(blocks: torch.Tensor, out_features: int, in_features: int,
                       rows: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The int8 codes [N, K] (with `rows` [n], only those, [n, K]) that `pack_int4_blocks`
    packed into `blocks`: its inverse."""
    chunks = blocks.shape[1] // 64
    words = blocks.view(-1, chunks, 4, 32, 2)  # [block, chunk, row, word, byte]
    index = torch.arange(out_features, device=blocks.device) if rows is None else rows
    picked = words[index // 4, :, index % 4]  # [n, chunk, word, byte]
    low, high = picked[..., 0].to(torch.int16), picked[..., 1].to(torch.int16)
    planes = torch.stack([low & 15, low >> 4, high & 15, high >> 4], dim=2)  # [n, chunk, plane, word]
    codes = (planes - 8).to(torch.int8).reshape(index.shape[0], chunks * 128)
    return codes[:, :in_features].contiguous()


def pack_int4_blocks(codes: torch.Tensor, width: int) -> torch.Tensor:
    """int4 codes int8 [N, K] in [-8, 7] as the kernels read them (csrc/gemv_int4.cpp):
    padded with zero codes to `width` (a multiple of 128) inputs and to a multiple of 4 rows,
    then per block of 4 rows and chunk of 128 inputs, each row's 64 bytes, read as 32
    little-endian words: word j holds inputs j, 32 + j, 64 + j and 96 + j, each + 8, in its
    nibbles 0..3. A block's rows lie side by side so the kernel reads one stream. Returns
    uint8 [ceil(N / 4) * 4, width / 2]."""
    n, k = codes.shape
    assert width % 128 == 0 and width >= k
    rows = -(-n // 4) * 4
    q = torch.nn.functional.pad(codes.to(torch.int16), (0, width - k, 0, rows - n)) + 8
    q = q.reshape(rows // 4, 4, width // 128, 4, 32)  # [block, row, chunk, plane, word]
    low = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # a word's low byte: nibbles 0 and 1
    high = q[:, :, :, 2] | (q[:, :, :, 3] << 4)
    words = torch.stack([low, high], dim=-1).to(torch.uint8)  # [block, row, chunk, 32, 2]
    return words.permute(0, 2, 1, 3, 4).reshape(rows, width // 2).contiguous()


A8_BLOCK = 32  # inputs per activation scale in the W8A8 / W4A8 kernels (q8_0's block)
A8_LANES = 16  # blocks per chunk of the kernels' layout


def pack_a8_blocks(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 codes [N, K] (within ±127 for bits 8, ±7 for bits <= 4) as the W8A8 / W4A8
    kernels read them (csrc/gemv_a8.cpp): padded with zero codes to whole blocks of 32 inputs
    and a multiple of 4 rows; per block of 4 rows and chunk of 16 blocks (the last chunk the
    rest), each row's 8 steps, step s holding bytes 4s..4s+3 of each block in turn; stored
    code + 128 (bits 8) or code + 8 in nibbles, steps 2t and 2t + 1 low and high (bits <= 4).
    Returns uint8 [ceil(N / 4) * 4, blocks * 32] (bits 8) or [.., blocks * 16]."""
    n, k = codes.shape
    blocks, rows = -(-k // A8_BLOCK), -(-n // 4) * 4
    q = torch.nn.functional.pad(codes.to(torch.int16), (0, blocks * A8_BLOCK - k, 0, rows - n))
    q = (q + (128 if bits == 8 else 8)).reshape(rows, blocks, 8, 4)  # [row, block, step, byte]
    full = blocks // A8_LANES * A8_LANES
    parts = [q[:, :full].reshape(rows, -1, A8_LANES, 8, 4), q[:, full:].reshape(rows, 1, -1, 8, 4)]
    return torch.cat([_a8_chunks(p, bits) for p in parts if p.numel()], dim=1).reshape(rows, -1)


def unpack_a8_blocks(blocks: torch.Tensor, out_features: int, in_features: int, bits: int,
                     rows: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The int8 codes [N, K] (with `rows` [n], only those, [n, K]) that `pack_a8_blocks` packed
    into `blocks` for `bits`: its inverse."""
    total = -(-in_features // A8_BLOCK)
    padded = blocks.shape[0]
    step_bytes = 4 if bits == 8 else 2  # a block's bytes per step (nibble pairs for int4)
    per_block = 8 * step_bytes  # 8 steps
    flat = blocks.reshape(padded // 4, -1)  # [row block, bytes]: the parts side by side
    parts, at = [], 0
    full = total // A8_LANES * A8_LANES
    for lanes, chunks in ((A8_LANES, full // A8_LANES), (total - full, 1)):
        if not lanes or not chunks:
            continue
        size = chunks * 4 * lanes * per_block
        part = flat[:, at : at + size].reshape(padded // 4, chunks, 4, -1).transpose(1, 2)
        part = part.reshape(padded, chunks, -1).to(torch.int16)  # [R, C, chunk bytes]
        if bits == 8:
            q = part.reshape(padded, chunks, 8, lanes, 4)
        else:  # steps 2t and 2t + 1 in a byte's low and high nibbles
            pairs = part.reshape(padded, chunks, 4, lanes, 4)
            q = torch.stack([pairs & 15, pairs >> 4], dim=3).reshape(padded, chunks, 8, lanes, 4)
        parts.append(q.permute(0, 1, 3, 2, 4).reshape(padded, chunks * lanes, 8, 4))  # [R, block, step, byte]
        at += size
    codes = torch.cat(parts, dim=1).reshape(padded, -1) - (128 if bits == 8 else 8)
    codes = codes[:out_features, :in_features] if rows is None else codes[rows, :in_features]
    return codes.to(torch.int8).contiguous()


def _a8_chunks(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q [R, C, L, 8, 4] (row, chunk, block, step, byte) -> uint8 [R / 4, C * 4 * chunk bytes]:
    steps before blocks, nibble pairs for int4, a block's 4 rows side by side per chunk."""
    r, c, lanes = q.shape[:3]
    q = q.permute(0, 1, 3, 2, 4)  # [R, C, step, block, byte]
    if bits <= 4:
        q = q.reshape(r, c, 4, 2, lanes, 4)
        q = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # steps 2t and 2t + 1: low and high nibbles
    q = q.reshape(r // 4, 4, c, -1).transpose(1, 2)  # [R / 4, C, row, chunk bytes]
    return q.reshape(r // 4, -1).to(torch.uint8)


def int4_kernel_layout(group_size: int | None, in_features: int) -> tuple[int, int] | None:
    """(width, group) the int4 kernel runs a layer with: inputs padded to a multiple of 128
    and the kernel's group (32, a multiple of 64 dividing in_features, or the padded width for
    one scale per channel); None when the grid's group fits neither. The kernel's scales have
    ceil(width / group) columns."""
    width = -(-in_features // 128) * 128
    if group_size is None:
        return width, width
    if group_size == 32 or (group_size % 64 == 0 and in_features % group_size == 0):
        return width, group_size
    return None


def build() -> Status:
    """Build the library for this source, torch and CPU unless it is built already, trying
    again after a failure an earlier process remembered (models/kernel_build.py). Raises
    BuildError (a RuntimeError) with the compiler's output on failure."""
    if (reason := kernel_build.unsupported_cpu(kernel_build.cpu_flags())) is not None:
        raise kernel_build.BuildError(reason)
    found = kernel_build.find()
    if found is None:
        kernel_build.build(kernel_build.build_dir() / kernel_build.library_name())
    else:  # built for another checkout, in the cache: a copy here, where the tests look
        kernel_build.into_build_dir(found)
    status.cache_clear()
    return status()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m decodekit.models.kernels", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--build", action="store_true",
        help="build the kernels for this source, torch and CPU unless built (scripts/setup.sh runs this)",
    )
    args = parser.parse_args(argv)
    if args.build:
        try:
            build()
        except kernel_build.BuildError as error:
            print(f"decodekit kernels not built; the pure-torch paths will run. {error}", file=sys.stderr)
            return 1
    state = status(build=False)
    where = f": {state.library}" if state.library else ""
    print(f"decodekit kernels: {'available' if state.available else 'unavailable'} ({state.reason}){where}")
    if state.available:  # the activation-quantised ops need AVX-512 VNNI for their wide variant
        a8 = {2: "avx512-vnni", 1: "avx2"}[torch.ops.decodekit.a8_isa()]
        print(f"W8A8 / W4A8 kernels (activation_bits=8): {a8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
