"""decodekit's float32 small-M GEMM (`decodekit::linear_gemm`, csrc/gemm.cpp): the float64
product within float32 rounding on odd shapes, the same bits as linear_t's axpy kernel (one
sum order for a row whatever rows share the call, and on AVX2), traced by torch.compile, and
PyTorch's path when the kernels are off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from isa_variants import same_bits_per_isa

import decodekit as dk
from decodekit.models import kernels

needs_kernels = pytest.mark.skipif(
    not kernels.available(), reason=f"native kernels unavailable: {kernels.status().reason}"
)
# (M, K, N): N past whole tiles of 64 columns and vectors of 16, K odd, below 64 (one input
# half) and past a panel of 256; M under and past the row tiles from which AVX2 packs panels.
SHAPES = [
    (9, 45, 37),
    (16, 256, 1376),
    (17, 513, 65),
    (23, 7, 3),
    (64, 300, 130),
    (33, 688, 16),
    (2, 31, 200),
    (200, 1100, 70),  # one block of rows, each input half over several panels
    (272, 1100, 70),  # two blocks: 264 rows (AVX2: 66 tiles, packed panels), then 8
    (20, 300, 1024),  # rows of wt 4 KiB apart: AVX2 packs from 3 row tiles
]


def _operands(m: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K], a weight [N, K] in the transposed layout (models/native.py), bias [N]."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(k, n, generator=g) / k**0.5).t()
    return torch.randn(m, k, generator=g), weight, torch.randn(n, generator=g)


@needs_kernels
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_gemm_equals_the_float64_product(m, k, n, with_bias):
    x, w, b = _operands(m, k, n)
    bias = b if with_bias else None
    y = torch.ops.decodekit.linear_gemm(x, w, bias)
    expected = F.linear(x.double(), w.double(), bias.double() if with_bias else None)
    torch.testing.assert_close(y, expected.float(), atol=2e-5 * k**0.5, rtol=1e-5)
    # linear_t's axpy kernel sums in the same order: the same bits
    assert torch.equal(y, torch.ops.decodekit.linear_t(x, w.t(), bias))


@needs_kernels
def test_float_linear_gives_a_row_the_same_bits_whatever_the_rows():
    # A row's outputs must not depend on how many rows share the call (engine: the compiled
    # step's buckets against the eager step; a verification span against one-row steps),
    # whichever kernel the row count takes (linear_t below the ISA's GEMM_MIN_ROWS, the GEMM from it).
    assert kernels._gemm_from == kernels.GEMM_MIN_ROWS[kernels.status().reason]
    for n in (75, kernels.LARGE_MATRIX // 200 + 1):  # a small matrix and a large one
        x, w, b = _operands(70, 200, n, seed=1)
        together = kernels.float_linear(x, w, b)
        for count in (1, 2, 3, 5, 7, 8, 9, 16, 31, 32, 33, 64):
            parts = torch.cat([kernels.float_linear(x[i : i + count], w, b) for i in range(0, 70, count)])
            assert torch.equal(parts, together), (n, count)
        assert torch.equal(kernels.float_linear(x[:, None], w, b)[:, 0], together)  # [..., K] in


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_t_gives_each_row_one_row_bits(dtype):
    # linear_t runs its rows over chunks of 256 columns of wt (csrc/gemv.cpp, kAxpyColumns):
    # N over two chunks and not a multiple of 8, K with a remainder past the steps of 4.
    g = torch.Generator().manual_seed(3)
    x, wt = torch.randn(11, 203, generator=g), torch.randn(203, 517, generator=g).to(dtype)
    together = torch.ops.decodekit.linear_t(x, wt, None)
    alone = torch.cat([torch.ops.decodekit.linear_t(x[i : i + 1], wt, None) for i in range(11)])
    assert torch.equal(together, alone)
    torch.testing.assert_close(together, x.double() @ wt.double(), atol=1e-3, rtol=1e-4, check_dtype=False)


@needs_kernels
def test_gemm_gives_the_same_bits_on_two_threads():
    # Threads split the column tiles: each output is still summed by one thread, in one order.
    x, w, b = _operands(64, 896, 1152, seed=2)
    threads = torch.get_num_threads()
    one = torch.ops.decodekit.linear_gemm(x, w, b)
    torch.set_num_threads(2)
    try:
        two = torch.ops.decodekit.linear_gemm(x, w, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_kernels
def test_gemm_copies_a_row_major_weight():
    x, w, b = _operands(12, 40, 24)
    row_major = w.contiguous()
    assert torch.equal(
        torch.ops.decodekit.linear_gemm(x, row_major, b), torch.ops.decodekit.linear_gemm(x, w, b)
    )


@needs_kernels
def test_the_avx2_gemm_gives_the_same_bits(tmp_path):
    # The instruction set is chosen once per process: each variant in a child process.
    script = "\n".join([
        "import sys, torch",
        "from decodekit.models import kernels as k",
        "assert k.status().reason == sys.argv[2], k.status().reason",
        f"shapes = {SHAPES!r}",
        "out = []",
        "for i, (m, kk, n) in enumerate(shapes):",
        "    torch.manual_seed(i)",
        "    x, w, b = torch.randn(m, kk), torch.randn(kk, n).t(), torch.randn(n)",
        "    out.append(torch.ops.decodekit.linear_gemm(x, w, b if i % 2 else None))",
        "torch.save(out, sys.argv[1])",
    ])  # fmt: skip
    same_bits_per_isa(script, tmp_path)


@needs_kernels
def test_gemm_traces_under_torch_compile():
    kernels.register_fakes()
    layer = torch.nn.Linear(96, 40)
    layer.weight = torch.nn.Parameter(layer.weight.detach().t().contiguous().t())
    x = torch.randn(2, 16, 96)

    def step(rows):
        return kernels.float_linear(rows, layer.weight, layer.bias)

    with torch.no_grad():
        compiled = torch.compile(step, fullgraph=True, dynamic=False)(x)
        assert kernels.traceable() and torch.equal(compiled, step(x))


def _forward_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.forward(tokens, model.new_cache(tokens.shape[0]))


@needs_kernels
def test_shakespeare_batch_on_the_gemm_matches_pytorch(monkeypatch):
    # A [4, 24] prefill: 96 rows through the GEMM, against PyTorch's sgemm with the kernels off.
    model = dk.load_model("shakespeare")
    tokens = torch.randint(0, model.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
    native = _forward_logits(model, tokens)
    monkeypatch.setenv(kernels.DISABLE_ENV, "0")
    kernels.status.cache_clear()
    try:
        assert not kernels.available()
        reference = _forward_logits(model, tokens)
    finally:
        monkeypatch.undo()
        kernels.status.cache_clear()
    torch.testing.assert_close(native, reference, atol=1e-4, rtol=1e-4)


def test_a_hooked_layer_is_called_as_a_module_whatever_the_rows():
    """compress's calibration (compress/apply.py) reads each Linear's input through a forward
    pre-hook: a hooked layer runs as a module, not on the kernels, at 1 row and at 64."""
    import decodekit as dk

    model = dk.load_model("shakespeare")
    layer = model.net.layers[0].self_attn.qkv_proj
    seen = []
    handle = layer.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[-2]))
    try:
        for length in (1, 64):
            model.forward(torch.arange(1, length + 1)[None], model.new_cache(1))
    finally:
        handle.remove()
    assert seen == [1, 64]
