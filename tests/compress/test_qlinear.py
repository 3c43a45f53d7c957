import pytest
import torch
from torch import nn

from decodekit.compress import QuantizedLinear, QuantSpec, pack_int4, quantize_rtn, unpack_int4


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
    ("bits", "group_size", "bias"),
    [(8, None, True), (8, 32, False), (4, None, False), (4, 32, True), (3, 16, True), (6, None, True)],
)
@pytest.mark.parametrize("rows", [1, 40])  # fewer / more rows than a group: both group paths
def test_output_equals_linear_with_dequantised_weight(bits, group_size, bias, rows):
    linear = _linear(128, 64, bias, seed=bits)
    qlinear = QuantizedLinear.from_linear(linear, QuantSpec(bits, group_size))
    assert qlinear.qweight.dtype == (torch.uint8 if bits <= 4 else torch.int8)
    reference = nn.Linear(128, 64, bias=bias)
    with torch.no_grad():
        reference.weight.copy_(qlinear.dequantized_weight())
        if bias:
            reference.bias.copy_(linear.bias)
    x = torch.randn(rows, 1, 128, generator=torch.Generator().manual_seed(0))  # [B, T, K]
    with torch.no_grad():
        assert torch.allclose(qlinear(x), reference(x), atol=1e-5, rtol=1e-5)


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
    with pytest.raises(ValueError, match=r"codes must lie in \[-7, 7\] for 4 bits"):
        qlinear.set_codes(torch.full((2, 8), 8, dtype=torch.int8), torch.ones(2, 1))
    with pytest.raises(ValueError, match="do not fit a 2x8 layer"):
        qlinear.set_codes(torch.zeros(2, 9, dtype=torch.int8), torch.ones(2, 1))
