import pytest
import torch
from torch import nn

from decodekit.compress import (
    QuantizedLinear,
    QuantSpec,
    dequantize,
    gptq_quantize,
    hessian_from_inputs,
    pack_int4,
    quantize_rtn,
    unpack_int4,
)
from decodekit.models.qlinear import kernel_counts, set_kernels

# PyTorch's kernel paths and their names; decodekit's own kernels: tests/models/test_kernels.py
pytestmark = pytest.mark.usefixtures("torch_kernels_only")


def test_int4_pack_round_trip_covers_every_code_and_odd_width():
    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 1)[:, :15]  # [3, 15]
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 8)
    assert torch.equal(unpack_int4(packed, 15), codes)
    # Byte j holds column j (low nibble) and column 8 + j (high nibble):
    # codes -8 and 0 -> 0x08; codes -2 (0xE) and 6 -> 0x6E; code -1 and the pad -> 0x0F.
    assert packed[0, 0].item() == 0x08 and packed[0, 6].item() == 0x6E
    assert packed[0, 7].item() == 0x0F


def _linear(in_features: int, out_features: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


@pytest.mark.parametrize(
    ("bits", "group_size", "bias", "kernel"),
    [(8, None, True, "int8pack"), (8, 32, False, "unpack"), (4, None, False, "int4pack"),
     (4, 32, True, "int4pack"), (3, 16, True, "unpack"), (3, 64, False, "int4pack"),
     (6, None, True, "int8pack")],
)
@pytest.mark.parametrize("rows", [1, 40, 80])  # fewer / more rows than a group; past PACKED_MAX_ROWS
def test_output_equals_linear_with_dequantised_weight(bits, group_size, bias, kernel, rows):
    linear = _linear(128, 64, bias, seed=bits)
    qlinear = QuantizedLinear.from_linear(linear, QuantSpec(bits, group_size))
    assert qlinear.qweight.dtype == (torch.uint8 if bits <= 4 else torch.int8)
    assert qlinear.kernel == kernel
    x = torch.randn(rows, 1, 128, generator=torch.Generator().manual_seed(0))  # [B, T, K]
    with torch.no_grad():
        packed = qlinear(x)
        qlinear.set_kernel("unpack")  # the fallback, in float32: equal to float up to rounding
        unpacked = qlinear(x)
    reference = nn.Linear(128, 64, bias=bias)
    with torch.no_grad():
        reference.weight.copy_(qlinear.dequantized_weight())
        if bias:
            reference.bias.copy_(linear.bias)
    with torch.no_grad():
        expected = reference(x)
    assert torch.allclose(unpacked, expected, atol=1e-5, rtol=1e-5)
    # The packed kernels run in bfloat16 (8 significant bits): outputs of size ~1 within 2 %.
    assert packed.dtype == torch.float32
    assert torch.allclose(packed, expected, atol=0.02, rtol=0.02)


@pytest.mark.parametrize(("bits", "code_bytes"), [(8, 64 * 128), (5, 64 * 128), (4, 64 * 64)])
def test_weights_stay_integer_in_memory(bits, code_bytes):
    qlinear = QuantizedLinear.from_linear(_linear(128, 64, False, 0), QuantSpec(bits))
    assert qlinear.qweight.element_size() == 1
    assert qlinear.qweight.numel() == code_bytes
    assert qlinear.scales.shape == (64, 1)
    assert not any(p.dtype.is_floating_point and p.numel() > 64 for p in qlinear.parameters())


def test_codes_survive_storage():
    linear = _linear(64, 16, False, 1)
    spec = QuantSpec(4, group_size=16)
    codes, scales = quantize_rtn(linear.weight, spec)
    qlinear = QuantizedLinear.from_linear(linear, spec)
    assert torch.equal(qlinear.codes(), codes) and torch.equal(qlinear.scales, scales)


@pytest.mark.parametrize("in_features", [128, 40])  # the int8 kernel path, and the fallback
def test_bfloat16_input_agrees_with_float32(in_features):
    linear = _linear(in_features, 64, True, 2)
    qlinear = QuantizedLinear.from_linear(linear, QuantSpec(8))
    x = torch.randn(3, 2, in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y32 = qlinear(x)
        y16 = qlinear(x.bfloat16())
        y16_strided = qlinear(x.transpose(0, 1).bfloat16()).transpose(0, 1)
    assert y16.dtype == torch.bfloat16
    assert torch.allclose(y16.float(), y32, atol=0.05, rtol=0.02)
    assert torch.equal(y16_strided, y16)


def test_codes_out_of_range_are_rejected():
    qlinear = QuantizedLinear(8, 2, bits=4, bias=False)
    with pytest.raises(ValueError, match=r"codes must lie in \[-8, 7\] for 4 bits"):
        qlinear.set_codes(torch.full((2, 8), 8, dtype=torch.int8), torch.ones(2, 1))
    with pytest.raises(ValueError, match="do not fit a 2x8 layer"):
        qlinear.set_codes(torch.zeros(2, 9, dtype=torch.int8), torch.ones(2, 1))


def _bf16_reference(x: torch.Tensor, qlinear: QuantizedLinear) -> torch.Tensor:
    """x Ŵᵀ in float64 with x and the scales rounded to bfloat16, as the packed kernels see them."""
    scales = qlinear.scales.to(torch.bfloat16).double()
    weight = dequantize(qlinear.codes(), scales).double()
    return x.to(torch.bfloat16).double() @ weight.T


@pytest.mark.parametrize(
    ("bits", "group_size", "method"),
    [(4, 32, "rtn"), (4, 64, "gptq"), (4, None, "rtn-width-688"), (3, None, "rtn-width-40"),
     (4, 128, "rtn"), (4, 256, "gptq"), (4, None, "gptq"),
     (4, 512, "rtn"), (8, None, "gptq"), (8, None, "rtn")],
)
def test_packed_kernel_equals_the_dequantised_matmul(bits, group_size, method):
    # Codes c and scales s must give exactly x (c s)ᵀ: the int4 kernel's grid is (q - 8) s + z,
    # so q = c + 8 and z = 0; a wrong offset or zero moves every output by ~8 s Σx, far
    # outside the bfloat16 rounding of the output allowed here.
    # Per channel, any width: the kernel's inputs are padded with zero weights to 32k.
    width = int(method.rpartition("-")[2]) if "width" in method else 512
    g = torch.Generator().manual_seed(bits)
    weight = torch.randn(48, width, generator=g)
    spec = QuantSpec(bits, group_size)
    if method == "gptq":
        inputs = torch.randn(256, 512, generator=g)
        codes, scales = gptq_quantize(weight, hessian_from_inputs(inputs), spec)
    else:
        codes, scales = quantize_rtn(weight, spec)
    qlinear = QuantizedLinear.from_linear(nn.Linear(width, 48, bias=False), spec, codes, scales)
    assert qlinear.kernel == ("int4pack" if bits <= 4 else "int8pack")
    x = torch.randn(3, width, generator=g)
    with torch.no_grad():
        y = qlinear(x)
    expected = _bf16_reference(x, qlinear)
    scale = (x.abs().double() @ qlinear.dequantized_weight().abs().double().T)  # Σ|x||w| [3, 48]
    assert float(((y.double() - expected).abs() / scale).max()) < 2**-7


@pytest.mark.parametrize(
    ("in_features", "out_features", "bits", "group_size", "reason"),
    [(96, 64, 4, 48, "no kernel group of 32..256 divides the group 48"),
     (128, 24, 4, 32, "out_features not a multiple of 16"),
     (96, 64, 4, 16, "group 16 is smaller than the kernel's 32"),
     (128, 64, 8, 32, "int8 with groups"),
     (40, 64, 8, None, "int8 with in_features not a multiple of 16")],
)
def test_fallback_where_no_kernel_applies(in_features, out_features, bits, group_size, reason):
    linear = _linear(in_features, out_features, True, 3)
    qlinear = QuantizedLinear.from_linear(linear, QuantSpec(bits, group_size))
    assert qlinear.kernel == "unpack", reason
    assert qlinear.kernel_weight.numel() == 0 and qlinear.kernel_scales.numel() == 0
    x = torch.randn(2, in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(qlinear(x), x @ qlinear.dequantized_weight().T + linear.bias, atol=1e-5)
    with pytest.raises(ValueError, match=r"kernel must be 'auto' or 'unpack' for this layer.*got 'int4pack'"):
        qlinear.set_kernel("int4pack")


def test_set_kernel_switches_and_names_what_applies():
    qlinear = QuantizedLinear.from_linear(_linear(64, 32, False, 4), QuantSpec(4, 32))
    assert qlinear.kernel == "int4pack" and qlinear.kernel_weight.numel() > 0
    with pytest.raises(ValueError, match=r"'auto', 'unpack' or 'int4pack'.*got 'int8pack'"):
        qlinear.set_kernel("int8pack")
    qlinear.set_kernel("unpack")
    assert qlinear.kernel == "unpack" and qlinear.kernel_weight.numel() == 0
    qlinear.set_kernel("auto")
    assert qlinear.kernel == "int4pack" and qlinear.kernel_weight.numel() > 0
    model = nn.Sequential(qlinear, QuantizedLinear.from_linear(_linear(32, 16, False, 5), QuantSpec(8)))
    assert kernel_counts(model) == {"int4pack": 1, "int8pack": 1}
    set_kernels(model, "unpack")
    assert kernel_counts(model) == {"unpack": 2}
    with pytest.raises(ValueError, match="'auto' or 'unpack' for a whole model, got 'int4pack'"):
        set_kernels(model, "int4pack")


def test_loading_a_state_dict_repacks_and_the_layer_pickles():
    import io

    source = QuantizedLinear.from_linear(_linear(64, 32, True, 6), QuantSpec(4, 32))
    target = QuantizedLinear(64, 32, bits=4, group_size=32)
    target.load_state_dict(source.state_dict())  # qweight, scales, bias: not the kernel's copy
    assert "kernel_weight" not in source.state_dict()
    assert torch.equal(target.kernel_weight, source.kernel_weight)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    buffer = io.BytesIO()
    torch.save(target, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        assert torch.equal(restored(x), source(x)) and torch.equal(target(x), source(x))


@pytest.mark.parametrize("flags, dtype", [({"avx2", "fma"}, torch.float32),
                                          ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16),
                                          ({"avx2", "amx_bf16"}, torch.bfloat16), (None, torch.bfloat16)])
def test_the_prefill_gemm_runs_in_bfloat16_only_where_the_cpu_multiplies_it(monkeypatch, flags, dtype):
    """Above PACKED_MAX_ROWS rows a packed layer runs one GEMM over its dequantised weight, in
    bfloat16 only on CPUs with a native bfloat16 product (a Zen 3 emulates it at a fifth of
    float32's speed, issue 39): its output is that GEMM's, bit for bit."""
    from decodekit.models import qlinear as module

    monkeypatch.setattr(module, "cpu_flags", lambda: flags)
    monkeypatch.delenv("DECODEKIT_GEMV_ISA", raising=False)  # the flags decide, not a forced ISA
    module.prefill_dtype.cache_clear()
    try:
        assert module.prefill_dtype() == dtype
        layer = QuantizedLinear.from_linear(_linear(128, 64, False, seed=4), QuantSpec(4, None))
        assert layer.kernel == "int4pack"
        x = torch.randn(module.PACKED_MAX_ROWS + 16, 128, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            weight = module.dequantize(layer.codes(), layer.scales, dtype)
            expected = torch.nn.functional.linear(x.to(dtype), weight)
            assert torch.equal(layer.packed_matmul(x), expected.to(torch.float32))
    finally:
        module.prefill_dtype.cache_clear()


def test_the_forced_avx2_kernels_prefill_in_float32_as_an_avx2_cpu(monkeypatch):
    """DECODEKIT_GEMV_ISA=avx2 emulates an AVX2-only CPU on an AVX-512 one (issue 39's
    measurements): its prefill GEMM then runs in float32 whatever the CPU's bfloat16 flags."""
    from decodekit.models import qlinear as module

    monkeypatch.setattr(module, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    monkeypatch.setenv("DECODEKIT_GEMV_ISA", "avx2")
    module.prefill_dtype.cache_clear()
    try:
        assert module.prefill_dtype() == torch.float32
        monkeypatch.delenv("DECODEKIT_GEMV_ISA")
        module.prefill_dtype.cache_clear()
        assert module.prefill_dtype() == torch.bfloat16
    finally:
        module.prefill_dtype.cache_clear()
