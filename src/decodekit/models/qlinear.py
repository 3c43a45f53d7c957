"""`QuantizedLinear`: a drop-in `nn.Linear` whose weight stays in integers in memory, and
the integer grid it stores (compress/ writes it, `load_model` of a compressed directory
reads it: models/compressed.py).

The grid, its codes' storage and the quantisers that fill it are quant_grid.py's.

A layer may also hold zero points, `offsets` float32 [N, G], one per scale: then
Ŵ = codes · scales + offsets (GGUF's Q4_K, whose blocks are w = d·q - m with q in 0..15,
stored as codes q - 8 and offsets 8·d - m). Every path below computes x (codes · scales)ᵀ and
adds (Σ_group x) offsetsᵀ, a [M, G] x [G, N] product (`offset_term`): G = K / 32 for Q4_K, so
it reads 1/32 of the weight's elements.

Each layer runs its matmuls on one of these paths, its `kernel` (`choose_kernel`; issues 15
and 23):

- "int8gemv" / "int4gemv": decodekit's own GEMV kernels (models/kernels.py, csrc/gemv.cpp),
  where they are built, for up to PACKED_MAX_ROWS rows. int8gemv reads the stored int8 codes
  and float32 scales, per channel or per group of any size, with x in float32 (weight-only:
  the numbers of "unpack" up to summation order). int4gemv reads the codes in its own layout
  (`kernels.pack_int4_blocks`, built at load), one scale per channel or groups of 32 or 64j,
  with x rounded to bfloat16 as int4pack does; the layer then holds the codes in that layout
  only (`qweight` empty, `codes_layout` names it; so do "int8a8" / "int4a8" below): a state
  dict, `codes()`, another device and the other paths unpack them again (`stored_qweight`,
  `kernels.unpack_int4_blocks`, `unpack_a8_blocks`), and a prefill dequantises straight from
  it (`kernels.dequantize_blocks`). A second copy had doubled an int4 model's resident weights.
  Above PACKED_MAX_ROWS rows (a prefill) they take the packed kernels' prefill path: one
  GEMM over the weight dequantised per call (`prefill_dtype`) (grouped int8 too: its float32
  "unpack" matmul prefilled at 0.47x llama.cpp's q8_0 at 240M, BENCHMARKS.md). Where the
  kernels are not built, the layers choose among the paths below (`torch_kernel`).

- "int8a8" / "int4a8": opt-in activation quantisation (`QuantSpec.activation_bits` 8, set by
  `CompressConfig(activation_bits=8)` / `decodekit compress --activation-bits 8` and stored in
  the checkpoint): llama.cpp's q8_0 / q4_0 numerics, W8A8 / W4A8. x is quantised per block of
  32 inputs to int8 with one float scale per block (`quantize_activations`), and each block's
  dot product with the codes is an integer one (AVX-512 VNNI, or AVX2; csrc/gemv_a8.cpp),
  scaled by the block's and the weights' scales (per channel, or groups of 32j). The weights
  are repacked at load (`kernels.pack_a8_blocks`, never saved). These kernels run every row
  count, prefills too (W8A8 on AVX2 from 16 rows on csrc/gemm_a8.cpp's register-blocked
  tiles), and compute an x row's outputs with the same operations whatever the rows beside it:
  a prompt's prefill gives each position the bits a one-token decode step would. On the Zen 3
  (AVX2) they prefill a 240M model's layers at 1.0-2.8x (W4A8) and 0.6-1.6x (W8A8) the speed
  of PyTorch's float32 GEMM, where dequantising the weight per call and one float GEMM, the
  path before, ran at 0.4-0.95x; the model's W4A8 prefill doubled, W8A8's rose by a fifth
  (BENCHMARKS.md, "Prefill on the W8A8 / W4A8 kernels"). Such a layer computes x̂ Ŵᵀ on every
  path: "unpack" (no kernels) quantises x the same way, and PyTorch's weight-only kernels
  never run it.
- "int4pack" (2..4 bits): PyTorch's CPU int4 kernel `_weight_int4pack_mm_for_cpu` over the
  weight repacked at load time by `_convert_weight_to_int4pack_for_cpu` (`int4_kernel_pack`).
  Its grid is w = (q - 8) · s + z with q in 0..15 and one (s, z) per group of 32, 64, 128
  or 256 inputs; our symmetric codes c in ±qmax (qmax <= 7) are q = c + 8 with z = 0, and a
  larger group (or one scale per channel) repeats its scale over the kernel's groups, so
  the kernel computes exactly x · (c · s)ᵀ, up to bfloat16 rounding. It needs N % 16 == 0
  and a group size that one of 32..256 divides; one scale per channel always fits, the
  inputs padded with zero weights to a multiple of 32 (`int4_kernel_width`). Its layout
  depends on the CPU's vector width (AVX-512 and AVX2 pack differently), so it is never
  saved: checkpoints keep the portable nibbles of `pack_int4`, and both are held.
- "int8pack" (5..8 bits, one scale per channel, K % 16 == 0): `_weight_int8pack_mm` over
  the stored int8 codes, scales in bfloat16.
- "unpack": the fallback where no packed kernel applies (other shapes, groups at 5..8
  bits, the ops missing, or inputs on another device). It converts codes to float in the
  input's dtype on every call: per channel y = (x Qᵀ) · s (for int4, as two matmuls over
  the halves of the input, `int4_halves_matmul`); per group with fewer rows than the group
  size y = Σ_g (x_g Q_gᵀ) · s_g (`grouped_matmul`); otherwise Ŵ = Q · s and one matmul.

Both packed kernels are fast only with bfloat16 activations (with float32 ones they were
5-30x slower than a float32 matmul, PyTorch 2.13 CPU), so the packed paths cast the input
to bfloat16 and the output back: a float32 model stays float32 around its linear layers.
They are GEMV kernels: their cost grows with every row, so above `PACKED_MAX_ROWS` rows
(a prefill) a weight-only layer dequantises its weight once and runs one GEMM in `prefill_dtype()`:
bfloat16 where the CPU multiplies it natively (AVX-512-BF16 or AMX; on the AVX-512 dev CPU it
beat both the kernels and a float32 GEMM at 400 rows, BENCHMARKS.md, "Real model shapes:
packed low-precision kernels"), float32 elsewhere: without those instructions PyTorch's
bfloat16 GEMM emulates them, and a quantised 240M model prefilled at 15-16 tok/s against its
float32 twin's 72 on a Zen 3 (BENCHMARKS.md, issue 39).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from decodekit.models import kernels
from decodekit.models.hugepages import on_huge_pages
from decodekit.models.kernel_build import cpu_flags
from decodekit.models.quant_grid import (
    QuantSpec,
    dequantize,
    grouped_matmul,
    int4_halves_matmul,
    pack_int4,
    quantize_activations,
    quantize_rtn,
    unpack_int4,
)

KERNELS = ("int4gemv", "int8gemv", "int4a8", "int8a8", "int4pack", "int8pack", "unpack")
NATIVE_KERNELS = ("int4gemv", "int8gemv", "int4a8", "int8a8")  # decodekit's own (models/kernels.py)
ACTIVATION_KERNELS = ("int4a8", "int8a8")  # x quantised too (activation_bits 8)
# the kernels whose layout is then the layer's only copy of its codes (module docstring)
CODES_IN_KERNEL = ("int4gemv", "int4a8", "int8a8")
INT4_KERNEL_GROUPS = (256, 128, 64, 32)  # the group sizes `_weight_int4pack_mm_for_cpu` takes
# The CPU flags of native bfloat16 matrix products (module docstring, `prefill_dtype`).
BFLOAT16_GEMM_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def prefill_dtype() -> torch.dtype:
    """The dtype of a packed layer's prefill GEMM: bfloat16 where the CPU has a native bfloat16
    product (or its flags are unknown: not Linux), else float32 (module docstring). Under
    DECODEKIT_GEMV_ISA=avx2 (the kernels' AVX2 variants forced: an AVX2-only CPU emulated on an
    AVX-512 one) float32, as on such a CPU."""
    if os.environ.get("DECODEKIT_GEMV_ISA") == "avx2":
        return torch.float32
    flags = cpu_flags()
    return torch.bfloat16 if flags is None or flags & BFLOAT16_GEMM_FLAGS else torch.float32


# Above this many rows a packed layer dequantises to bfloat16 and runs one GEMM instead
# (module docstring): measured crossovers on the dev CPU were ~65 rows for int8, ~110 for int4.
PACKED_MAX_ROWS = 64


def int4_kernel_width(spec: QuantSpec, in_features: int) -> int:
    """Inputs the int4 kernel sees: per channel, in_features padded with zero weights to a
    multiple of 32 (the zeros add nothing), so every width gets the kernel; with groups,
    in_features itself."""
    if spec.group_size is None:
        return -(-in_features // INT4_KERNEL_GROUPS[-1]) * INT4_KERNEL_GROUPS[-1]
    return in_features


def int4_kernel_group(spec: QuantSpec, in_features: int) -> int | None:
    """The int4 kernel's group size for this grid: the largest of 256..32 dividing the
    grid's group (per channel: the padded width, `int4_kernel_width`), or None."""
    group = spec.group_size or int4_kernel_width(spec, in_features)
    return next((g for g in INT4_KERNEL_GROUPS if group % g == 0), None)


def choose_kernel(spec: QuantSpec, in_features: int, out_features: int) -> str:
    """The matmul path of a layer (module docstring): decodekit's "int4gemv" / "int8gemv"
    ("int4a8" / "int8a8" with activation_bits 8) where the native kernels are built
    (`kernels.status()`), else `torch_kernel`'s."""
    if spec.activation_bits is not None:
        return ("int4a8" if spec.bits <= 4 else "int8a8") if kernels.available() else "unpack"
    fits = spec.bits > 4 or kernels.int4_kernel_layout(spec.group_size, in_features) is not None
    if fits and kernels.available():
        return "int4gemv" if spec.bits <= 4 else "int8gemv"
    return torch_kernel(spec, in_features, out_features)


def torch_kernel(spec: QuantSpec, in_features: int, out_features: int) -> str:
    """PyTorch's packed kernel for this layer, "int4pack" or "int8pack", or "unpack" (always,
    with activation_bits: PyTorch's kernels are weight-only)."""
    aten = torch.ops.aten
    if spec.activation_bits is not None:
        return "unpack"
    if spec.bits <= 4:
        fits = out_features % 16 == 0 and int4_kernel_group(spec, in_features) is not None
        has_op = hasattr(aten, "_weight_int4pack_mm_for_cpu")
        return "int4pack" if fits and has_op else "unpack"
    # Other K made `_weight_int8pack_mm` segfault on PyTorch 2.13 CPU (K = 8, 24, 37, 40, 200).
    fits = spec.group_size is None and in_features % 16 == 0
    return "int8pack" if fits and hasattr(aten, "_weight_int8pack_mm") else "unpack"


def int4_kernel_pack(
    codes: torch.Tensor, scales: torch.Tensor, group: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 kernel's weight and scales_and_zeros for codes int8 [N, K] in ±7, scales [N, G],
    padded with zero codes to `width` inputs (one scale per channel only): (packed uint8,
    bfloat16 [width / group, N, 2]) with q = code + 8 and zero 0 (module docstring)."""
    codes = F.pad(codes.to(torch.int32), (0, width - codes.shape[1]))  # [N, width]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu((codes + 8).contiguous(), 1)
    per_group = scales.to(torch.float32).repeat_interleave(width // scales.shape[1] // group, dim=1)
    scales_and_zeros = torch.stack([per_group.T, torch.zeros_like(per_group.T)], dim=-1)
    return packed, scales_and_zeros.to(torch.bfloat16).contiguous()


def int4_kernel_matmul(
    x: torch.Tensor, packed: torch.Tensor, group: int, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    """x [..., K] times the int4 kernel's weight [N, width]ᵀ in bfloat16, x padded with zeros
    to the weight's width. Returns [..., N] in x's dtype."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # [M, K]
    width = packed.shape[1] * 2  # packed: uint8 [N, width / 2]
    if width > rows.shape[1]:
        rows = F.pad(rows, (0, width - rows.shape[1]))  # [M, width]
    rows = rows.contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, group, scales_and_zeros)
    return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)


def int8_kernel_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., K] times per-channel int8 codes [N, K] with bfloat16 scales [N], in bfloat16.
    Returns [..., N] in x's dtype."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()  # [M, K], contiguous
    y = torch._weight_int8pack_mm(rows, q, scales)  # [M, N]
    return y.reshape(*x.shape[:-1], q.shape[0]).to(x.dtype)


class QuantizedLinear(nn.Module):
    """y = x Ŵᵀ + b with Ŵ = codes · scales kept as integers (see module docstring).

    `kernel` names the matmul path ("int4pack", "int8pack" or "unpack"); `set_kernel`
    changes it ("unpack" always applies; a packed one only where `choose_kernel` picks it).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int = 8,
        group_size: int | None = None,
        bias: bool = True,
        offsets: bool = False,
        activation_bits: int | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__()
        self.spec = QuantSpec(bits, group_size, activation_bits)
        self.in_features = in_features
        self.out_features = out_features
        groups = self.spec.num_groups(in_features)
        if self.packed:
            codes = torch.zeros(out_features, (in_features + 1) // 2, dtype=torch.uint8, device=device)
        else:
            codes = torch.zeros(out_features, in_features, dtype=torch.int8, device=device)
        self.register_buffer("qweight", codes)
        scales = torch.ones(out_features, groups, dtype=torch.float32, device=device)
        self.register_buffer("scales", scales)
        # Zero points (module docstring): Ŵ = codes · scales + offsets.
        self.offsets: torch.Tensor | None
        if offsets:
            self.register_buffer("offsets", torch.zeros_like(scales))
        else:
            self.offsets = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        # The packed kernel's operands, derived from qweight and scales and never saved
        # (module docstring); empty until `prepare_kernel` fills them.
        empty = torch.empty(0, dtype=torch.uint8, device=device)
        self.register_buffer("kernel_weight", empty, persistent=False)
        self.register_buffer("kernel_scales", empty.to(torch.bfloat16), persistent=False)
        self.kernel = choose_kernel(self.spec, in_features, out_features)
        self.kernel_group = 0  # the int4 kernel's group size, set by `prepare_kernel`
        self.codes_layout: str | None = None  # the kernel whose layout holds the codes (qweight empty)
        self.register_load_state_dict_post_hook(_prepare_after_load)

    @property
    def packed(self) -> bool:
        """Whether the stored codes are two per byte (2..4 bits)."""
        return self.spec.bits <= 4

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        spec: QuantSpec,
        codes: torch.Tensor | None = None,
        scales: torch.Tensor | None = None,
    ) -> QuantizedLinear:
        """Quantise `linear` (round-to-nearest), or wrap given codes [N, K] and scales [N, G]."""
        if codes is None or scales is None:
            codes, scales = quantize_rtn(linear.weight, spec)
        has_bias = linear.bias is not None
        module = cls(linear.in_features, linear.out_features, spec.bits, spec.group_size, has_bias,
                     activation_bits=spec.activation_bits, device=linear.weight.device)  # fmt: skip
        module.set_codes(codes, scales)
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach().to(torch.float32))
        return module

    def set_codes(
        self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None = None
    ) -> None:
        """Store codes int8 [N, K] (in -qmax - 1..qmax), scales [N, G] and, for a layer built
        with `offsets=True`, its zero points [N, G]."""
        n, k = self.out_features, self.in_features
        if codes.shape != (n, k) or scales.shape != self.scales.shape:
            raise ValueError(
                f"codes {tuple(codes.shape)} / scales {tuple(scales.shape)} do not fit a "
                f"{n}x{k} layer with scales {tuple(self.scales.shape)}"
            )
        if (offsets is None) != (self.offsets is None):
            raise ValueError(f"this layer {'needs' if self.offsets is not None else 'has no'} offsets")
        if offsets is not None and offsets.shape != self.scales.shape:
            raise ValueError(
                f"offsets {tuple(offsets.shape)} must have the scales' shape {tuple(self.scales.shape)}"
            )
        qmax = self.spec.qmax
        if codes.numel() and (codes.min() < -qmax - 1 or codes.max() > qmax):
            raise ValueError(f"codes must lie in [-{qmax + 1}, {qmax}] for {self.spec.bits} bits")
        codes = codes.to(torch.int8)
        stored = pack_int4(codes) if self.packed else codes
        if self.codes_in_kernel():  # new codes replace the kernel's copy (module docstring)
            self.qweight, self.codes_layout = torch.empty_like(stored, device=self.scales.device), None
        self.qweight.copy_(stored)
        self.scales.copy_(scales.to(torch.float32))
        if offsets is not None:
            self.offsets.copy_(offsets.to(torch.float32))
        self.prepare_kernel()

    def set_kernel(self, kernel: str) -> None:
        """Run matmuls on `kernel`: "unpack", "auto" (`choose_kernel`'s), or the packed one
        `choose_kernel` picks for this layer."""
        best = choose_kernel(self.spec, self.in_features, self.out_features)
        fallback = torch_kernel(self.spec, self.in_features, self.out_features)
        kernel = best if kernel == "auto" else kernel
        allowed = ["auto", "unpack", *dict.fromkeys(k for k in (best, fallback) if k != "unpack")]
        if kernel not in allowed[1:]:
            names = ", ".join(map(repr, allowed[:-1])) + f" or {allowed[-1]!r}"
            raise ValueError(
                f"kernel must be {names} for this layer "
                f"({self.spec.bits} bits, {self.out_features}x{self.in_features}, "
                f"group {self.spec.group_size}), got {kernel!r}"
            )
        self.kernel = kernel
        self.prepare_kernel()

    def codes_in_kernel(self) -> bool:
        """Whether the layer holds its codes in a kernel's layout only (module docstring):
        `qweight` empty, `kernel_weight` the codes in the layout `codes_layout` names."""
        return getattr(self, "codes_layout", None) is not None

    def kernel_codes(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The int8 codes [N, K] (or those `rows`) unpacked from the kernel's layout."""
        n, k = self.out_features, self.in_features
        if self.codes_layout == "int4gemv":
            return kernels.unpack_int4_blocks(self.kernel_weight, n, k, rows)
        bits = 8 if self.codes_layout == "int8a8" else 4
        return kernels.unpack_a8_blocks(self.kernel_weight, n, k, bits, rows)

    def stored_qweight(self) -> torch.Tensor:
        """The codes as a checkpoint stores them (`qweight`: pack_int4's nibbles, or int8),
        unpacked from the kernel's layout where the layer keeps only that."""
        if not self.codes_in_kernel():
            return self.qweight
        codes = self.kernel_codes()
        return pack_int4(codes) if self.packed else codes

    def restore_codes(self) -> None:
        """The codes back in `qweight`, where every path reads them, if the kernel's layout held
        them alone."""
        if self.codes_in_kernel():
            self.qweight = self.stored_qweight()
            self.codes_layout = None

    def prepare_kernel(self) -> None:
        """(Re)build the packed kernel's operands from qweight and scales (or free them)."""
        self.restore_codes()
        weight = scales = None
        if self.kernel == "int4pack" and self.qweight.device.type == "cpu":
            group = int4_kernel_group(self.spec, self.in_features)
            assert group is not None
            self.kernel_group = group
            width = int4_kernel_width(self.spec, self.in_features)
            weight, scales = int4_kernel_pack(self.codes(), self.scales, group, width)
        elif self.kernel == "int4gemv" and self.qweight.device.type == "cpu":
            layout = kernels.int4_kernel_layout(self.spec.group_size, self.in_features)
            assert layout is not None
            width, self.kernel_group = layout
            weight = kernels.pack_int4_blocks(self.codes(), width)  # uint8 [4j >= N, width / 2]
            columns = -(-width // self.kernel_group)  # the padded width's groups
            padding = columns - self.scales.shape[1]  # no copy of the scales where none is needed
            scales = F.pad(self.scales, (0, padding)) if padding else self.scales
        elif self.kernel in ACTIVATION_KERNELS and self.qweight.device.type == "cpu":
            weight = kernels.pack_a8_blocks(self.codes(), 8 if self.kernel == "int8a8" else 4)
            group = self.spec.group_size  # None, or whole blocks of 32 (QuantSpec)
            scales = self.scales if group is None else self.scales.repeat_interleave(group // 32, dim=1)
        elif self.kernel == "int8gemv" and self.qweight.device.type == "cpu":
            self.kernel_group = self.in_features // self.scales.shape[1]
            scales = self.scales  # float32 [N, G]: the kernel reads the stored codes
            self.qweight = on_huge_pages(self.qweight)  # which it streams (hugepages.py)
        elif self.kernel == "int8pack":
            scales = self.scales[:, 0].to(torch.bfloat16)
        self.kernel_weight = on_huge_pages(weight) if weight is not None else self.qweight.new_empty(0)
        self.kernel_scales = scales if scales is not None else self.scales.new_empty(0).bfloat16()
        if self.kernel in CODES_IN_KERNEL and weight is not None:
            self.qweight = self.qweight.new_empty(0)  # one copy of the codes: the kernel's
            self.codes_layout = self.kernel

    def codes(self) -> torch.Tensor:
        """Integer codes int8 [N, K]."""
        if self.codes_in_kernel():
            return self.kernel_codes()
        return unpack_int4(self.qweight, self.in_features) if self.packed else self.qweight

    def dequantized_weight(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None
                           ) -> torch.Tensor:  # fmt: skip
        """Ŵ [N, K] in `dtype` (with the offsets, where the layer has them); with `rows` [n], only
        those rows, [n, K] (the same values: every step is row by row)."""
        scales, offsets = self.scales, self.offsets
        if rows is not None:
            scales = scales[rows]
            offsets = None if offsets is None else offsets[rows]
        if self.codes_in_kernel():
            codes = self.kernel_codes(rows)
        else:
            codes = self.qweight if rows is None else self.qweight[rows]
            codes = unpack_int4(codes, self.in_features) if self.packed else codes
        weight = dequantize(codes, scales)
        if offsets is not None:
            n, k = weight.shape
            weight = (weight.view(n, offsets.shape[1], -1) + offsets[..., None]).view(n, k)
        return weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = self.kernel in NATIVE_KERNELS
        if native and torch.compiler.is_compiling() and not kernels.traceable():
            y = self.unpacked_matmul(x)  # no fake kernels registered: trace the plain maths
        elif self.kernel != "unpack" and x.is_cpu and self.kernel_scales.numel():
            few = x.numel() <= PACKED_MAX_ROWS * self.in_features  # a decode step's rows
            if native and (few or self.kernel in ACTIVATION_KERNELS):  # a8: any rows (module docstring)
                y = self.native_matmul(x)
                return y if self.offsets is None else y + offset_term(x, self.offsets)
            y = self.packed_matmul(x)  # a prefill: one GEMM (module docstring)
        else:
            y = self.unpacked_matmul(x)
        if self.offsets is not None:
            y = y + offset_term(x, self.offsets)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def packed_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] Ŵᵀ in bfloat16 through the packed kernel, or one GEMM (`prefill_dtype`) over
        the dequantised weight above PACKED_MAX_ROWS rows (module docstring). Returns x's dtype."""
        if x.numel() // self.in_features > PACKED_MAX_ROWS:
            dtype = prefill_dtype()
            eager = kernels.eager_op(self.scales, x)
            if eager and self.codes_layout == "int4gemv":  # from the kernel's layout, one pass
                weight = kernels.dequantize_blocks(self.kernel_weight, self.scales, self.in_features, dtype)
            elif eager and not self.codes_in_kernel():  # one pass over the codes, the same numbers
                weight = kernels.dequantize(self.qweight, self.scales, self.in_features, dtype)
            else:
                weight = dequantize(self.codes(), self.scales, dtype)  # [N, K]
            return F.linear(x.to(dtype), weight).to(x.dtype)
        if self.kernel == "int8pack":
            return int8_kernel_matmul(x, self.qweight, self.kernel_scales)
        return int4_kernel_matmul(x, self.kernel_weight, self.kernel_group, self.kernel_scales)

    def native_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] Ŵᵀ + b on decodekit's kernels (models/kernels.py): int8 with x in float32,
        int4 with x rounded to bfloat16; float32 sums. Returns x's dtype."""
        ops = torch.ops.decodekit  # the ops take x [..., K] and return [..., N]
        if self.kernel == "int8a8":
            return ops.linear_w8a8(x, self.kernel_weight, self.kernel_scales, self.bias)
        if self.kernel == "int4a8":
            return ops.linear_w4a8(x, self.kernel_weight, self.kernel_scales, self.bias)
        if self.kernel == "int8gemv":
            return ops.linear_rows(x, self.qweight, self.kernel_scales, self.kernel_group, self.bias)
        return ops.linear_int4(x, self.kernel_weight, self.kernel_scales, self.kernel_group, self.bias)

    def unpacked_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] Ŵᵀ converting the codes to x's dtype (the fallback; module docstring);
        with activation_bits, x̂ Ŵᵀ (`quantize_activations`): the W8A8 / W4A8 kernels' maths."""
        if self.spec.activation_bits is not None:
            x = quantize_activations(x)
        scales = self.scales.to(x.dtype)  # [N, G]
        if self.spec.group_size is None:
            if self.packed:
                return int4_halves_matmul(x, self.stored_qweight(), self.in_features) * scales[:, 0]
            return F.linear(x, self.stored_qweight().to(x.dtype)) * scales[:, 0]  # (W8A8: unpacked)
        if x.numel() // self.in_features < self.spec.group_size:
            return grouped_matmul(x, self.codes(), scales)
        return F.linear(x, dequantize(self.codes(), self.scales, x.dtype))  # offsets: forward adds them

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.codes_in_kernel():  # the checkpoint's portable nibbles, not the empty buffer
            destination[prefix + "qweight"] = self.stored_qweight()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        self.restore_codes()  # a buffer of the stored shape to load into (the kernel's rebuilt after)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn, recurse=True):
        # to another device: the codes as stored go with the layer (only CPU kernels read the
        # kernel's layout)
        if self.codes_in_kernel() and fn(self.kernel_weight[:0]).device.type != "cpu":
            self.restore_codes()
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        group = "channel" if self.spec.group_size is None else f"group={self.spec.group_size}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.spec.bits}, {group}, bias={self.bias is not None}, "
            f"offsets={self.offsets is not None}, kernel={self.kernel}"
            + (f", activation_bits={self.spec.activation_bits}" if self.spec.activation_bits else "")
        )


class QuantizedEmbedding(nn.Module):
    """An embedding lookup over a `QuantizedLinear`'s grid (a tied GGUF embedding whose grid is
    also the output head: models/gguf_model.py): the rows looked up are dequantised, codes ·
    scales (+ offsets), the values `dequantized_weight()` holds, so no float copy of the
    vocabulary is kept (545 MB at Qwen2.5's 151,936 x 896 in float32). The head owns, and
    moves, the tensors; this module only reads them."""

    def __init__(self, grid: QuantizedLinear, dtype: torch.dtype):
        super().__init__()
        self._grid = (grid,)  # not a submodule: its tensors are the head's, in its state dict
        self.dtype = dtype

    @property
    def device(self) -> torch.device:
        return self._grid[0].scales.device

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        grid = self._grid[0]
        rows = grid.dequantized_weight(self.dtype, rows=tokens.reshape(-1))  # [T, K]
        return rows.view(*tokens.shape, grid.in_features)


def offset_term(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(Σ_group x) offsetsᵀ: what zero points [N, G] add to x [..., K] Ŵᵀ. Returns [..., N]
    in x's dtype, summed in float32."""
    groups = offsets.shape[1]
    sums = x.float().reshape(*x.shape[:-1], groups, x.shape[-1] // groups).sum(-1)  # [..., G]
    return (sums @ offsets.T).to(x.dtype)


def _prepare_after_load(module: QuantizedLinear, incompatible_keys: object) -> None:
    """Rebuild the kernel's operands once `load_state_dict` has filled qweight and scales (a
    module-level function, so the layer still pickles)."""
    module.prepare_kernel()


def kernel_counts(model: nn.Module) -> dict[str, int]:
    """How many `QuantizedLinear` layers of `model` run on each kernel (only those in use)."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            counts[module.kernel] = counts.get(module.kernel, 0) + 1
    return counts


def set_kernels(model: nn.Module, kernel: str) -> None:
    """`set_kernel(kernel)` on every `QuantizedLinear` of `model`; "auto" or "unpack" apply
    to every layer."""
    if kernel not in ("auto", "unpack"):
        raise ValueError(f"kernel must be 'auto' or 'unpack' for a whole model, got {kernel!r}")
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.set_kernel(kernel)
