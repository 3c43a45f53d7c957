"""The W8A8 / W4A8 kernels over many rows (csrc/gemv_a8.cpp, csrc/gemm_a8.cpp; issue 39): a
prefill runs the integer kernels, and each of its rows has the bits a one-row decode call gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from isa_variants import on_one_and_two_threads, same_bits_per_isa
from torch import nn

from decodekit.models import kernels
from decodekit.models.qlinear import PACKED_MAX_ROWS, QuantizedLinear
from decodekit.models.quant_grid import QuantSpec, quantize_activations

needs_kernels = pytest.mark.skipif(
    not kernels.available(), reason=f"native kernels unavailable: {kernels.status().reason}"
)

# (bits, group, K, N). The kernels' layout has chunks of 16 blocks of 32 inputs; the last chunk
# may be short: 600 inputs end in 3 blocks (its second half of lanes empty), 896 in 12 (a short
# second half), 1,216 in 6, 4,864 in 8 (a whole first half, an empty second). N = 13 ends in a
# partial block of 4 weight rows (no read may pass the end of the weights there).
CASES = [
    (8, None, 600, 13), (8, 32, 896, 12), (8, 64, 1216, 9), (8, None, 4864, 13),
    (4, None, 600, 13), (4, 32, 896, 12), (4, 64, 1216, 9), (4, None, 4864, 13),
]  # fmt: skip


def _layer(bits: int, group: int | None, k: int, n: int) -> QuantizedLinear:
    torch.manual_seed(bits * 1000 + k + n)
    return QuantizedLinear.from_linear(nn.Linear(k, n), QuantSpec(bits, group, activation_bits=8))


@needs_kernels
@pytest.mark.parametrize(("bits", "group", "k", "n"), CASES)
def test_a_prefill_gives_each_row_the_bits_of_a_one_row_call(bits, group, k, n):
    # Above PACKED_MAX_ROWS rows the layers ran one float GEMM over the dequantised weight (the
    # same function up to rounding); now every row count runs the integer kernels, W8A8 from 16
    # rows on gemm_a8.cpp's tiles, whose float sums repeat the GEMV's operations lane by lane.
    # 203 rows at K = 4,864 span several of the kernel's panels of x rows.
    layer = _layer(bits, group, k, n)
    assert layer.kernel == ("int8a8" if bits == 8 else "int4a8")
    rows = 203 if k > 1000 else PACKED_MAX_ROWS + 6
    x = torch.randn(1, rows, k, generator=torch.Generator().manual_seed(k))
    with torch.no_grad():
        prefill = layer(x)  # [1, rows, n]
        one_by_one = torch.cat([layer(x[:, i : i + 1]) for i in range(rows)], dim=1)
        tiles = torch.cat([layer(x[:, i : i + 17]) for i in range(0, rows, 17)], dim=1)  # 17 rows a call
        reference = F.linear(quantize_activations(x), layer.dequantized_weight(), layer.bias)
    assert torch.equal(prefill, one_by_one)
    assert torch.equal(tiles, one_by_one)
    torch.testing.assert_close(prefill, reference, atol=1e-4, rtol=1e-4)  # x̂ Ŵᵀ, not weight-only


@needs_kernels
@pytest.mark.parametrize("group", [None, 32])
def test_w8a8_tiles_stay_exact_at_the_extreme_codes(group):
    # gemm_a8.cpp's tiles sum maddubs(|q|, sign(w, q)) pairs (at most 2 * 127 * 127) in int32:
    # codes +-127 against inputs all at +-max (q = +-127 everywhere), 20 rows (the tiles' path),
    # must give the exact integer sums scaled.
    k, n = 1184, 6  # 37 blocks: two chunks of 16 and a short one
    codes = torch.tensor([127, -127, 1, 0, 127, -1], dtype=torch.int8)[:, None].repeat(1, k)
    codes[4, 1::2] = -127
    groups = 1 if group is None else k // 32
    scales = torch.linspace(0.5, 1.5, n * groups).view(n, groups)
    spec = QuantSpec(8, group, activation_bits=8)
    layer = QuantizedLinear.from_linear(nn.Linear(k, n, bias=False), spec, codes, scales)
    x = torch.ones(20, k)
    x[1::2] = -3.0
    with torch.no_grad():
        native = layer(x)
        expected = F.linear(quantize_activations(x), layer.dequantized_weight())
    torch.testing.assert_close(native, expected, atol=1e-2, rtol=1e-5)


@needs_kernels
def test_prefill_rows_have_the_same_bits_on_avx512_and_avx2(tmp_path):
    # The AVX-512 VNNI variant runs a8_dot4_avx512 at every row count, the AVX2 one the tiles
    # (int8, from 16 rows) or a8_dot4_avx2 (int4): all the same operations per output.
    script = "\n".join([
        "import sys, torch",
        "from decodekit.models import kernels as k",
        "from decodekit.models.qlinear import QuantizedLinear",
        "from decodekit.models.quant_grid import QuantSpec",
        "assert k.status().reason == sys.argv[2], k.status().reason",
        "assert torch.ops.decodekit.a8_isa() == {'avx512': 2, 'avx2': 1}[sys.argv[2]], 'no VNNI'",
        "out = []",
        "cases = [(8, None, 896, 13), (8, 32, 1184, 9), (4, None, 600, 7), (4, 64, 1216, 9)]",
        "for i, (b, g, kk, n) in enumerate(cases):",
        "    torch.manual_seed(i)",
        "    layer = QuantizedLinear.from_linear(torch.nn.Linear(kk, n), QuantSpec(b, g, activation_bits=8))",
        "    out.append(layer(torch.randn(70, kk)))",
        "torch.save(out, sys.argv[1])",
    ])  # fmt: skip
    same_bits_per_isa(script, tmp_path, missing=("AssertionError: avx2", "no VNNI"))


@needs_kernels
@pytest.mark.parametrize("bits", [8, 4])
def test_a_prefill_has_the_same_bits_on_one_and_two_threads(bits):
    # Threads split the weight blocks of each panel of x rows; every output is still one
    # thread's fixed sequence of operations. 896 -> 1152 at 100 rows splits between two threads.
    layer = _layer(bits, None, 896, 1152)
    x = torch.randn(100, 896, generator=torch.Generator().manual_seed(3))
    one, two = on_one_and_two_threads(layer, x)
    assert torch.equal(one, two)
