"""decodekit's native GEMV kernels (models/kernels.py): each equals the float / unpacking
reference, on odd shapes too, and models decode the same tokens on them as on PyTorch's
paths. Kernel tests skip (saying why) where the extension is not built; the pure-torch
fallback is tested either way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from isa_variants import on_one_and_two_threads, same_bits_per_isa
from torch import nn

import decodekit as dk
from decodekit.models import kernels
from decodekit.models.qlinear import QuantizedLinear
from decodekit.models.quant_grid import QuantSpec, quantize_activations

needs_kernels = pytest.mark.skipif(
    not kernels.available(), reason=f"native kernels unavailable: {kernels.status().reason}"
)
GREEDY = dk.SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
SHAPES = [(1, 896, 64), (1, 45, 37), (3, 200, 13), (4, 64, 100), (2, 17, 3)]  # (M, K, N)


def _x_w(m: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(m, k, generator=g),
        torch.randn(n, k, generator=g) / k**0.5,
        torch.randn(n, generator=g),
    )


@needs_kernels
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("layout", ["transposed", "row-major"])
def test_float32_kernel_equals_f_linear(m, k, n, layout):
    x, w, b = _x_w(m, k, n)
    weight = w.t().contiguous().t() if layout == "transposed" else w
    y = kernels.float_linear(x, weight, b)
    # Summation order differs from BLAS: float32 rounding only.
    torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_kernels_equal_the_float32_product_rounded_once(m, k, n, dtype):
    x, w, b = _x_w(m, k, n)
    x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
    y = kernels.float_linear(x, w, b)
    assert y.dtype == dtype
    expected = F.linear(x.float(), w.float(), b.float()).to(dtype)  # exact products, f32 sums
    torch.testing.assert_close(y, expected, atol=1e-2, rtol=1e-2)


@needs_kernels
@pytest.mark.parametrize(("m", "k", "n"), [*SHAPES, (1, 4864, 40), (6, 896, 33)])
def test_bfloat16_times_bfloat16_is_the_exact_product_rounded_once_within_one_step(m, k, n):
    # bf16 x with bf16 weights runs vdpbf16ps on AVX-512 (csrc/gemv.cpp, dot_bf16_avx512): the
    # products are exact, but the f32 sums round in the instruction's order, with denormals
    # flushed. Bound against the exact (float64) sum: the output's own bf16 rounding (half a
    # step, 2^-9 relative; allow a whole step, 2^-8) plus k float32 roundings of the running
    # sum (k * 2^-24 of the sum of |products|). The FMA kernel meets the same bound.
    x, w, _ = _x_w(m, k, n)
    x, w = x.bfloat16(), w.bfloat16()
    y = kernels.float_linear(x, w, None)
    assert y.dtype == torch.bfloat16
    exact = x.double() @ w.double().t()
    bound = 2**-8 * exact.abs() + k * 2**-24 * (x.double().abs() @ w.double().abs().t())
    assert bool(((y.double() - exact).abs() <= bound).all())
    # f32 x with bf16 weights stays on the f32 kernel: exact products, f32 sums, f32 output.
    y32 = kernels.float_linear(x.float(), w, None)
    torch.testing.assert_close(y32, x.float() @ w.float().t(), atol=1e-5, rtol=1e-5)


def _quantized(bits: int, group: int | None, k: int, n: int) -> QuantizedLinear:
    torch.manual_seed(bits * 100 + (group or 0) + k)
    return QuantizedLinear.from_linear(nn.Linear(k, n), QuantSpec(bits, group))


INT_CASES = [  # (bits, group, K, N): per channel and grouped, K and N not multiples of 16 / 4
    (8, None, 896, 64), (8, None, 45, 7), (8, 32, 96, 13), (8, 64, 128, 9), (8, 128, 256, 5),
    (4, None, 896, 64), (4, None, 45, 7), (4, 32, 96, 13), (4, 64, 128, 9), (4, 128, 384, 6),
    (4, 192, 192, 5),  # int4: 192 inputs padded to 256, the last group short (padding)
    (3, 32, 32, 3),
]  # fmt: skip


@needs_kernels
@pytest.mark.parametrize(("bits", "group", "k", "n"), INT_CASES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17, 64])  # the kernels block x rows by 4
def test_integer_kernels_equal_the_unpacking_fallback(bits, group, k, n, rows):
    layer = _quantized(bits, group, k, n)
    assert layer.kernel == ("int4gemv" if bits <= 4 else "int8gemv")
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        native = layer(x)
        layer.set_kernel("unpack")
        unpacked = layer(x)
        # int4 rounds x to bfloat16 (as torch's int4pack); int8 reads it in float32 (weight-only)
        expected = layer(x.bfloat16().float()) if bits <= 4 else unpacked
    torch.testing.assert_close(native, expected, atol=1e-4, rtol=1e-4)
    assert (native - unpacked).abs().max() <= 0.02 * unpacked.abs().max()


@needs_kernels
@pytest.mark.parametrize(("group", "k", "n"), [(None, 896, 64), (64, 896, 40), (None, 4864, 24),
                                               (None, 200, 9)])  # fmt: skip
def test_int4_is_near_exact_on_heavy_tailed_inputs(group, k, n):
    # The product with x rounded to bfloat16, in float64, against the kernel: the AVX-512 one
    # sums exact products in float32; the AVX2 one sums each plane of 32 inputs exactly over x
    # as int16 times a power of two, rounding inputs below 2^-7 of the plane's largest to 2^-15
    # of it (csrc/gemv_int4.cpp). Inputs of widely different sizes (x e^N(0, 1) spans ~e^6):
    # within 1e-4 of the largest output, where rounding x to bfloat16 moves them by ~1e-3. A
    # NaN or an infinity in x makes none of its row's outputs a finite number (AVX2: NaN).
    layer = _quantized(4, group, k, n)
    assert layer.kernel == "int4gemv"
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, k, generator=g) * torch.exp(torch.randn(3, k, generator=g))
    x[2, 100:140] *= 1e-6  # a plane of tiny inputs beside normal ones
    with torch.no_grad():
        y = layer(x).double()
        exact = x.bfloat16().double() @ layer.dequantized_weight(torch.float64).t() + layer.bias.double()
        assert (y - exact).abs().max() <= 1e-4 * exact.abs().max()
        for bad in (float("nan"), float("inf")):
            x_bad = x.clone()
            x_bad[1, k // 2] = bad
            out = layer(x_bad)
            assert not out[1].isfinite().any() and torch.equal(out[[0, 2]], layer(x[[0, 2]]))


WEIGHTS = ["float32", "bfloat16", "int8 g32", "int8 channel", "int4 channel", "int4 g64",
           "int8 channel a8", "int8 g64 a8", "int4 channel a8", "int4 g32 a8"]


@needs_kernels
@pytest.mark.parametrize("weight", WEIGHTS)
def test_a_row_computes_the_same_bits_whatever_rows_share_the_call(weight):
    # The kernels decode each weight block once for up to 4 x rows; each row's sum must still
    # run the same operations as when it is alone (a speculative verification span then
    # scores a token exactly as a one-row step would).
    x = torch.randn(17, 200, generator=torch.Generator().manual_seed(2))
    if weight in ("float32", "bfloat16"):
        dtype = getattr(torch, weight)
        w = (torch.randn(13, 200) / 200**0.5).to(dtype)
        x = x.to(dtype)

        def layer(rows):
            return kernels.float_linear(rows, w, None)
    else:
        bits = 8 if weight.startswith("int8") else 4
        group = {"g32": 32, "g64": 64}.get(weight.split()[1])
        k = 192 if group else 200  # per channel: a 200-input tail
        if weight.endswith("a8"):
            layer = _a8_layer(bits, group, 640 if group else 600, 13)  # a chunk of 16 blocks, a tail
            x = torch.randn(17, layer.in_features, generator=torch.Generator().manual_seed(2))
        else:
            layer = _quantized(bits, group, k, 13)
        x = x[:, : layer.in_features]
    with torch.no_grad():
        together = layer(x)
        for count in (1, 2, 3, 5):
            parts = torch.cat([layer(x[i : i + count]) for i in range(0, 17, count)])
            assert torch.equal(parts, together), count


@needs_kernels
@pytest.mark.parametrize("weight", ["float32", "bfloat16", "int8 channel", "int4 channel"])
def test_outputs_are_the_same_bits_on_one_and_two_threads(weight):
    # Each output is summed in one fixed order whatever the thread count (csrc/gemv.cpp: tasks
    # over blocks of outputs; the transposed f32 kernel's input halves are fixed, not per thread).
    # 896 -> 1152 is large enough to split between two threads.
    x, w, _ = _x_w(2, 896, 1152)
    if weight in ("float32", "bfloat16"):
        dtype = getattr(torch, weight)
        w = w.t().contiguous().t() if dtype == torch.float32 else w.to(dtype)
        x = x.to(dtype)

        def layer(rows):
            return kernels.float_linear(rows, w, None)
    else:
        linear = nn.Linear(896, 1152, bias=False)
        linear.weight.data = w
        layer = QuantizedLinear.from_linear(linear, QuantSpec(8 if weight.startswith("int8") else 4, None))
    one, two = on_one_and_two_threads(layer, x)
    assert torch.equal(one, two)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "k", "n"), [*SHAPES, (2, 130, 75)])
def test_half_transposed_weights_compute_exact_products_with_float32_sums(dtype, m, k, n):
    # linear_t over a bf16 / f16 wt [K, N]: each weight widens exactly to f32, x stays f32.
    x, w, b = _x_w(m, k, n)
    wt = w.t().contiguous().to(dtype)
    y = torch.ops.decodekit.linear_t(x, wt, b)
    torch.testing.assert_close(y, x @ wt.float() + b, atol=1e-5, rtol=1e-5)
    # bf16 / f16 x: the same f32 sums over x widened, rounded once to x's dtype.
    xh = x.to(dtype)
    yh = torch.ops.decodekit.linear_t(xh, wt, None)
    assert yh.dtype == dtype
    assert torch.equal(yh, torch.ops.decodekit.linear_t(xh.float(), wt, None).to(dtype))


@needs_kernels
def test_the_avx2_transposed_kernels_give_the_same_bits(tmp_path):
    # linear_t's AVX-512 and AVX2 variants run y = fma(w, x, y) in one order per output
    # (csrc/gemv.cpp, axpy_avx512 / axpy_avx2), for f32, bf16 and f16 weights alike.
    script = "\n".join([
        "import sys, torch",
        "from decodekit.models import kernels as k",
        "assert k.status().reason == sys.argv[2], k.status().reason",
        "out = []",
        "for i, (m, kk, n) in enumerate([(1, 896, 72), (3, 130, 75), (2, 64, 7)]):",
        "    for dtype in (torch.float32, torch.bfloat16, torch.float16):",
        "        torch.manual_seed(i)",
        "        x, wt = torch.randn(m, kk), torch.randn(kk, n).to(dtype)",
        "        out.append(torch.ops.decodekit.linear_t(x, wt, None))",
        "torch.save(out, sys.argv[1])",
    ])  # fmt: skip
    same_bits_per_isa(script, tmp_path)


@needs_kernels
def test_row_logsumexp_gives_the_same_bits_forced_to_avx2(tmp_path):
    # csrc/logsumexp.cpp has one AVX2 path, run on both instruction sets: forced to AVX2
    # (DECODEKIT_GEMV_ISA=avx2) it runs and its lanes give the same bits, rows with tails of
    # every length past a whole 16-float step, -inf entries and a real vocabulary's rows.
    script = "\n".join([
        "import sys, torch",
        "from decodekit.models import kernels as k",
        "assert k.status().reason == sys.argv[2], k.status().reason",
        "out = []",
        "for v in (1, 7, 16, 31, 2048, 151936):",
        "    torch.manual_seed(v)",
        "    x = torch.randn(3, v) * 4",
        "    x[1, : v // 2] = float('-inf')",
        "    out.append(torch.ops.decodekit.row_logsumexp(x))",
        "torch.save(out, sys.argv[1])",
    ])  # fmt: skip
    same_bits_per_isa(script, tmp_path)


@needs_kernels
def test_the_avx2_row_kernels_give_the_same_bits(tmp_path):
    # linear_rows' AVX2 variant (dotr_avx2) keeps dot4_avx512's 16 lanes as two halves, the
    # same FMAs per lane, the same group scaling and the same final reduction: f32, f16 and
    # bf16 rows with f32 x, and int8 per channel and in groups, one to five x rows (the AVX2
    # kernel's single rows and pairs), inputs with tails of every length class.
    script = "\n".join([
        "import sys, torch",
        "from decodekit.models import kernels as k",
        "from decodekit.models.qlinear import QuantizedLinear",
        "from decodekit.models.quant_grid import QuantSpec",
        "assert k.status().reason == sys.argv[2], k.status().reason",
        "out = []",
        "for i, (m, kk, n) in enumerate([(1, 896, 37), (2, 45, 9), (3, 130, 13), (5, 4864, 6), (4, 23, 5)]):",
        "    torch.manual_seed(i)",
        "    x, w = torch.randn(m, kk), torch.randn(n, kk) / kk**0.5",
        "    for dtype in (torch.float32, torch.float16, torch.bfloat16):",
        "        out.append(torch.ops.decodekit.linear(x, w.to(dtype), None))",
        "    for group in (None, 32, 64):",
        "        if group and kk % group:",
        "            continue",
        "        layer = QuantizedLinear.from_linear(torch.nn.Linear(kk, n), QuantSpec(8, group))",
        "        assert layer.kernel == 'int8gemv', layer.kernel",
        "        out.append(layer(x))",
        "torch.save(out, sys.argv[1])",
    ])  # fmt: skip
    same_bits_per_isa(script, tmp_path)


@needs_kernels
def test_the_kernel_tests_pass_on_the_avx2_variant_too():
    # The instruction set is chosen once per process, so on an AVX-512 CPU the tests of this
    # file ran the AVX-512 variants: the kernel-against-reference tests run again in a child
    # forced to AVX2 (~10 s of CPU), so CI on either ISA tests both (the tests that start
    # children per ISA themselves, and the whole-model decodes, are left out).
    if kernels.status().reason == "avx2":
        pytest.skip("this process runs the AVX2 variants already")
    env = {**os.environ, "DECODEKIT_GEMV_ISA": "avx2"}
    root = Path(__file__).resolve().parents[2]
    select = ("(equal or exact or same_bits or holds_its_codes) and not avx2 and not shakespeare "
              "and not decode")
    command = [sys.executable, "-m", "pytest", "-x", "-p", "no:cacheprovider", __file__, "-k", select]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout.splitlines()[-1], done.stdout[-500:]


@needs_kernels
def test_the_avx2_variant_gives_the_same_numbers():
    # The AVX2 code runs in a child process (the instruction set is chosen once per process).
    script = (
        "import torch; from decodekit.models import kernels as k; assert k.status().reason == 'avx2';"
        "torch.manual_seed(0); x = torch.randn(3, 75); w = torch.randn(21, 75);"
        "print(float((k.float_linear(x, w.t().contiguous().t(), None) - x @ w.t()).abs().max()));"
        "print(float((k.float_linear(x.bfloat16(), w.bfloat16(), None).float()"
        " - (x.bfloat16().float() @ w.bfloat16().float().t()).bfloat16().float()).abs().max()));"
        "from decodekit.models.qlinear import QuantizedLinear, QuantSpec;"
        "layers = [QuantizedLinear.from_linear(torch.nn.Linear(128, 21), QuantSpec(b, g))"
        " for b, g in ((8, None), (8, 32), (4, None), (4, 32), (4, 64))];"
        "x2 = torch.randn(6, 128); out = [l(x2) for l in layers]; [l.set_kernel('unpack') for l in layers];"
        "print(max(float((o - l(x2.bfloat16().float() if l.spec.bits <= 4 else x2)).abs().max())"
        " for o, l in zip(out, layers)))"
    )
    env = {**os.environ, "DECODEKIT_GEMV_ISA": "avx2"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    f32, bf16, ints = map(float, done.stdout.split())
    assert f32 < 1e-4 and bf16 <= 0.07 and ints < 1e-4


@pytest.mark.usefixtures("torch_kernels_only")
def test_the_pure_torch_fallback_runs_when_the_kernels_are_off():
    assert not kernels.available() and kernels.status().reason.startswith("disabled by DECODEKIT_KERNELS=0")
    layer = _quantized(8, 32, 96, 13)
    assert layer.kernel == "unpack"
    model = dk.load_model("shakespeare")
    [completion] = dk.generate(model, "ROMEO:", GREEDY)
    assert len(completion.token_ids) == GREEDY.max_new_tokens


def test_status_says_why_when_not_built(monkeypatch, tmp_path):
    from decodekit.models import kernel_build

    monkeypatch.setattr(kernel_build, "BUILD_DIR", tmp_path / "native")
    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path / "cache"))
    kernels.status.cache_clear()
    try:
        state = kernels.status(build=False)  # a report never builds
        assert not state.available
        assert state.reason == "not built yet; `python -m decodekit.models.kernels --build` builds it"
    finally:
        monkeypatch.undo()
        kernels.status.cache_clear()


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shakespeare_greedy_tokens_equal_on_kernels_and_torch(dtype, monkeypatch):
    model = dk.load_model("shakespeare", dtype=dtype)
    [native] = dk.generate(model, "ROMEO:", GREEDY)
    monkeypatch.setenv(kernels.DISABLE_ENV, "0")
    kernels.status.cache_clear()
    try:
        [reference] = dk.generate(model, "ROMEO:", GREEDY)
    finally:
        monkeypatch.undo()
        kernels.status.cache_clear()
    assert native.token_ids == reference.token_ids


@needs_kernels
@pytest.mark.parametrize(("bits", "group"), [(8, None), (8, 64), (4, None), (4, 32)])
def test_quantised_models_decode_as_their_unpack_kernel(bits, group):
    from decodekit.compress.recipe import CompressConfig, quantized_copy
    from decodekit.models.qlinear import kernel_counts, set_kernels

    model = quantized_copy(dk.load_model("shakespeare"), CompressConfig("rtn", bits=bits, group_size=group))
    assert set(kernel_counts(model.net)) == {"int4gemv" if bits <= 4 else "int8gemv"}
    tokens = torch.tensor([model.encode("ROMEO: But soft, what light")])
    native = model.forward(tokens, model.new_cache(1))  # prefill: today's paths
    [native_text] = dk.generate(model, "ROMEO:", GREEDY)
    set_kernels(model.net, "unpack")
    assert torch.allclose(native, model.forward(tokens, model.new_cache(1)), atol=0.05)
    [reference] = dk.generate(model, "ROMEO:", GREEDY)
    assert native_text.token_ids == reference.token_ids


def test_activations_are_quantised_per_block_of_32_as_q8_0():
    # A hand-computed block: max |x| = 1.27 -> d = 0.01; 0.005 is a tie (0.5 -> 0, to even),
    # 0.015 -> 1.5 -> 2; the second block is all zeros (scale 0, codes 0); the third holds one
    # input of a 65-input row (zero padded): d = 3 / 127, q = 127.
    x = torch.zeros(65)
    x[:4] = torch.tensor([1.27, -0.5, 0.005, 0.015])
    x[64] = -3.0
    got = quantize_activations(x)
    d = torch.tensor(1.27) / 127
    codes = torch.round(torch.tensor([1.27, -0.5, 0.005, 0.015]) * (1 / d))
    assert codes.tolist() == [127.0, -50.0, 0.0, 2.0]
    assert torch.equal(got[:4], codes * d) and not got[4:64].any()
    assert got[64] == -3.0 and got.shape == x.shape


A8_CASES = [  # (bits, group, K, N): chunks of 16 blocks and a tail, K not a multiple of 32
    (8, None, 896, 64), (8, None, 45, 7), (8, 32, 96, 13), (8, 64, 1216, 9), (8, 128, 256, 5),
    (4, None, 896, 64), (4, None, 45, 7), (4, 32, 96, 13), (4, 64, 1216, 9), (4, 128, 4864, 6),
]  # fmt: skip


def _a8_layer(bits: int, group: int | None, k: int, n: int) -> QuantizedLinear:
    torch.manual_seed(bits * 100 + (group or 0) + k)
    return QuantizedLinear.from_linear(nn.Linear(k, n), QuantSpec(bits, group, activation_bits=8))


@needs_kernels
@pytest.mark.parametrize(("bits", "group", "k", "n"), A8_CASES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 64])
def test_activation_quantised_kernels_equal_the_torch_reference(bits, group, k, n, rows):
    layer = _a8_layer(bits, group, k, n)
    assert layer.kernel == ("int4a8" if bits <= 4 else "int8a8")
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        native = layer(x)
        layer.set_kernel("unpack")  # x̂ Ŵᵀ in float32 (quantize_activations)
        reference = layer(x)
        expected = F.linear(quantize_activations(x), layer.dequantized_weight(), layer.bias)
        weight_only = F.linear(x, layer.dequantized_weight(), layer.bias)
    torch.testing.assert_close(reference, expected)
    # Integer block sums are exact; only the float sums over blocks round differently.
    torch.testing.assert_close(native, reference, atol=1e-4, rtol=1e-4)
    # ... and the activations really are quantised: not the weight-only function.
    assert not torch.allclose(native, weight_only, atol=1e-4, rtol=1e-4)
    assert (native - weight_only).abs().max() <= 0.05 * weight_only.abs().max()


@needs_kernels
@pytest.mark.parametrize("group", [None, 32])
def test_w4a8_block_sums_stay_exact_at_the_extreme_codes(group):
    # The AVX2 kernel adds a block's 8 steps of maddubs pairs in int16 before widening
    # (csrc/gemv_a8.cpp): code 7 (stored 15) against |q| = 127 makes every pair 3,810 and the 8
    # steps 30,480, just inside int16. Rows of extreme codes against inputs all at +-max (q = +-127
    # everywhere) must still give the exact integer sums: a wrapped lane would be 65,536 off.
    k, n = 1184, 6  # 37 blocks: two chunks of 16 and a tail
    codes = torch.tensor([7, -8, -7, 0, 7, 3], dtype=torch.int8)[:, None].repeat(1, k)
    codes[4, 1::2] = -8  # alternating extremes within a pair
    groups = 1 if group is None else k // 32
    scales = torch.linspace(0.5, 1.5, n * groups).view(n, groups)
    spec = QuantSpec(4, group, activation_bits=8)
    layer = QuantizedLinear.from_linear(nn.Linear(k, n, bias=False), spec, codes, scales)
    assert layer.kernel == "int4a8"
    x = torch.ones(2, k)
    x[1] = -3.0
    with torch.no_grad():
        native = layer(x)
        expected = F.linear(quantize_activations(x), layer.dequantized_weight())
    torch.testing.assert_close(native, expected, atol=0.1, rtol=1e-4)  # a wrap: >= 65,536 d s


@needs_kernels
def test_activation_quantised_avx2_variant_gives_the_same_bits(tmp_path):
    # The AVX2 code (maddubs, no VNNI) in a child process; every case's output bit for bit.
    script = "\n".join([
        "import sys, torch",
        "from decodekit.models import kernels as k",
        "from decodekit.models.qlinear import QuantizedLinear",
        "from decodekit.models.quant_grid import QuantSpec",
        "assert k.status().reason == sys.argv[2], k.status().reason",
        "assert torch.ops.decodekit.a8_isa() == {'avx512': 2, 'avx2': 1}[sys.argv[2]], 'no VNNI'",
        "cases = [(8, None, 896, 13), (8, 32, 1184, 9), (8, 64, 64, 7), (4, None, 45, 7),",
        "         (4, 32, 1184, 9), (4, 128, 4864, 6)]",
        "out = []",
        "for i, (b, g, kk, n) in enumerate(cases):",
        "    torch.manual_seed(i)",
        "    layer = QuantizedLinear.from_linear(torch.nn.Linear(kk, n), QuantSpec(b, g, activation_bits=8))",
        "    assert layer.kernel == ('int8a8' if b == 8 else 'int4a8')",
        "    out.append(layer(torch.randn(5, kk)))",
        "torch.save(out, sys.argv[1])",
    ])  # fmt: skip
    same_bits_per_isa(script, tmp_path, missing=("AssertionError: avx2", "no VNNI"))


@pytest.mark.usefixtures("torch_kernels_only")
def test_activation_bits_hold_without_the_kernels():
    # No kernels: the layer runs "unpack", and still computes x̂ Ŵᵀ (never silently weight-only).
    layer = _a8_layer(8, 32, 96, 13)
    assert layer.kernel == "unpack"
    x = torch.randn(3, 96)
    with torch.no_grad():
        expected = F.linear(quantize_activations(x), layer.dequantized_weight(), layer.bias)
        torch.testing.assert_close(layer(x), expected)
        big = torch.randn(70, 96)  # above PACKED_MAX_ROWS too
        expected = F.linear(quantize_activations(big), layer.dequantized_weight(), layer.bias)
        torch.testing.assert_close(layer(big), expected)
    with pytest.raises(ValueError, match="kernel must be 'auto' or 'unpack' for this layer"):
        layer.set_kernel("int8pack")


def test_activation_bits_are_checked():
    with pytest.raises(ValueError, match="activation_bits must be None \\(weight-only\\) or 8, got 4"):
        QuantSpec(8, None, activation_bits=4)
    with pytest.raises(ValueError, match="needs group_size None or a multiple of 32, got 16"):
        QuantSpec(4, 16, activation_bits=8)
    with pytest.raises(TypeError, match="activation_bits must be an int or None, got True"):
        QuantSpec(8, None, activation_bits=True)


@needs_kernels
@pytest.mark.parametrize("bits", [8, 4])
def test_activation_quantised_ops_trace_under_torch_compile(bits):
    # engine/compiled.py compiles decode steps whole: the ops need their fake kernels.
    kernels.register_fakes()
    layer = _a8_layer(bits, 32, 96, 13)
    x = torch.randn(2, 96)
    with torch.no_grad():
        eager = layer(x)
        compiled = torch.compile(layer, fullgraph=True, dynamic=False)(x)
    assert kernels.traceable() and torch.equal(compiled, eager)


@needs_kernels
@pytest.mark.parametrize(("bits", "group", "a8", "k", "n"), [
    (4, None, None, 896, 64), (4, 32, None, 96, 13), (4, 192, None, 192, 5),  # int4gemv
    (8, None, 8, 896, 64), (4, 32, 8, 608, 13), (8, 64, 8, 576, 6),  # int8a8, int4a8 (a last short chunk)
])  # fmt: skip
def test_a_layer_holds_its_codes_once(bits, group, a8, k, n):
    """An int4 GEMV (or W8A8 / W4A8) layer keeps its codes in the kernel's layout only
    (qlinear.py): no stored copy beside it. The codes, a state dict's, a fresh layer loaded
    from it, the fallback kernel and another device all still see the codes it was given; the
    outputs do not move."""
    from decodekit.models.quant_grid import pack_int4

    spec = QuantSpec(bits, group, a8)
    generator = torch.Generator().manual_seed(k + n)
    codes = torch.randint(-spec.qmax, spec.qmax + 1, (n, k), generator=generator, dtype=torch.int8)
    scales = torch.rand(n, spec.num_groups(k), generator=generator) + 0.5
    layer = QuantizedLinear.from_linear(nn.Linear(k, n), spec, codes, scales)
    kernel = "int4gemv" if a8 is None else f"int{bits}a8"
    assert layer.kernel == kernel and layer.codes_layout == kernel and layer.qweight.numel() == 0
    held = sum(t.numel() * t.element_size() for t in layer.buffers() if t.dtype in (torch.uint8, torch.int8))
    assert held == layer.kernel_weight.numel() <= (-(-n // 4) * 4) * (-(-k // 128) * 128) * bits // 8
    assert torch.equal(layer.codes(), codes)
    rows = torch.tensor([n - 1, 0])
    assert torch.equal(layer.dequantized_weight(rows=rows), layer.dequantized_weight()[rows])
    state = layer.state_dict()
    assert torch.equal(state["qweight"], pack_int4(codes) if bits == 4 else codes)
    x = torch.randn(3, k, generator=generator)
    with torch.no_grad():
        y = layer(x)
        fresh = QuantizedLinear(k, n, bits=bits, group_size=group, activation_bits=a8)
        fresh.load_state_dict(state)
        assert fresh.qweight.numel() == 0 and torch.equal(fresh(x), y)
        layer.set_kernel("unpack")  # the codes back where the fallback reads them
        assert torch.equal(layer.codes(), codes) and layer.qweight.numel() > 0
        same_input = x.bfloat16().float() if a8 is None else x  # int4gemv rounds x to bfloat16
        torch.testing.assert_close(layer(same_input), y, atol=1e-3, rtol=1e-3)
        unpacked = layer.unpacked_matmul(x)
        layer.set_kernel("auto")
        assert layer.qweight.numel() == 0 and torch.equal(layer(x), y)
        # the fallback a traced step takes without the kernels' fakes, from the kernel's copy
        assert torch.equal(layer.unpacked_matmul(x), unpacked)
    other = torch.randint(-spec.qmax, spec.qmax + 1, (n, k), generator=generator, dtype=torch.int8)
    layer.set_codes(other, scales)  # new codes over the kernel's copy, then a state dict over those
    assert torch.equal(layer.codes(), other) and layer.qweight.numel() == 0
    layer.load_state_dict(state)
    assert torch.equal(layer.codes(), codes) and layer.qweight.numel() == 0
    moved = fresh.to("meta")  # another device: the stored codes go with it
    assert moved.qweight.shape == state["qweight"].shape and moved.qweight.device.type == "meta"
    assert not moved.codes_in_kernel()
