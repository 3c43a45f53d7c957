// decodekit::dequantize(codes, scales, in_features, out): a quantised layer's weight
// W[n, k] = code[n, k] * scale[n, k / group] written into `out`, float32 or bfloat16 (its
// dtype), for the one GEMM a prefill runs above qlinear.py's PACKED_MAX_ROWS rows. `out` is
// the caller's reused buffer (kernels.scratch): a fresh [N, K] allocation is page-faulted in
// on every call, ~3.5 of ~4.6 ms for an 896 -> 4864 layer's 17 MB on the Zen 3.
//
// The same numbers as qlinear.py's `dequantize` (codes and scales converted to the dtype, one
// product rounded once: float32, or bfloat16 rounded to nearest even), which ATen computes in
// ~6 passes over the weight (unpack, cat, convert, multiply): ~19 ms for an int4 896 -> 4864
// layer on the Zen 3, as long as the GEMM after it at 200 rows (BENCHMARKS.md, issue 39). Here
// one pass reads the codes and writes the weight.
//
// codes: int8 [N, K] (int8 layers), or uint8 [N, H] two int4 codes a byte (qlinear.py
// `pack_int4`: byte j holds column j in its low nibble and column H + j in its high one,
// both signed); scales: float32 [N, G] with G dividing K.
//
// decodekit::dequantize_blocks(blocks, scales, in_features, out): the same from the int4 GEMV
// kernel's own layout (kernels.py `pack_int4_blocks`: blocks of 4 rows, chunks of 128 inputs,
// each row's 64 bytes of 32 words whose nibbles 0..3 hold inputs j, 32 + j, 64 + j, 96 + j
// plus 8), which an int4 layer keeps instead of a second copy of its codes (qlinear.py).
#include "gemv_common.h"

#include <vector>

namespace {

// One row: its int4 codes sign-extended into `codes` (two plain loops: the low nibbles are
// columns [0, half), the high ones [half, K)), then per group w[k] = float(code) * scale,
// float32 or rounded to bfloat16. The multiply is the only rounding (codes up to ±127 are
// exact in bfloat16 too). Plain loops the compiler vectorises for AVX2.
template <bool BF16, bool INT4>
AVX2 void dequantize_row(const uint8_t* row, int64_t half, const float* scales, int64_t K, int64_t group,
                         int8_t* codes, void* out) {
  const int8_t* c = reinterpret_cast<const int8_t*>(row);
  if constexpr (INT4) {
    for (int64_t j = 0; j < half; ++j) codes[j] = int8_t(uint8_t(row[j] << 4)) >> 4;
    for (int64_t j = 0; j < K - half; ++j) codes[half + j] = int8_t(row[j]) >> 4;
    c = codes;
  }
  for (int64_t k0 = 0; k0 < K; k0 += group) {
    const float scale = BF16 ? bf16_to_float(float_to_bf16(scales[k0 / group])) : scales[k0 / group];
    if constexpr (BF16) {
      uint16_t* o = static_cast<uint16_t*>(out) + k0;
      for (int64_t k = 0; k < group; ++k) o[k] = float_to_bf16(float(c[k0 + k]) * scale);
    } else {
      float* o = static_cast<float*>(out) + k0;
      for (int64_t k = 0; k < group; ++k) o[k] = float(c[k0 + k]) * scale;
    }
  }
}

void dequantize(const at::Tensor& codes, const at::Tensor& scales_in, int64_t K, const at::Tensor& out) {
  TORCH_CHECK(isa() != kNone, "decodekit kernels need AVX2 + FMA");
  TORCH_CHECK(codes.dim() == 2 && codes.device().is_cpu() && codes.is_contiguous() &&
                  (codes.scalar_type() == at::kChar || codes.scalar_type() == at::kByte),
              "codes must be a contiguous CPU int8 [N, K] or uint8 [N, ceil(K / 2)] tensor");
  const bool int4 = codes.scalar_type() == at::kByte;
  const int64_t N = codes.size(0), width = codes.size(1);
  TORCH_CHECK(int4 ? width == (K + 1) / 2 : width == K, "codes hold ", width, " bytes a row, not ",
              int4 ? "ceil(K / 2)" : "K", " for K = ", K);
  const at::Tensor scales = scales_in.to(at::kFloat).contiguous();
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) > 0 && K % scales.size(1) == 0,
              "scales must be [N, G] with G dividing K = ", K);
  const int64_t G = scales.size(1), group = K / G;
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  TORCH_CHECK(out.device().is_cpu() && (bf16 || out.scalar_type() == at::kFloat) && out.is_contiguous() &&
                  out.dim() == 2 && out.size(0) == N && out.size(1) == K,
              "out must be a contiguous CPU ", bf16 ? "bfloat16" : "float32", " [", N, ", ", K,
              "] tensor (float32 or bfloat16)");
  const uint8_t* cp = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  char* op = static_cast<char*>(out.data_ptr());
  const int64_t out_row = K * (bf16 ? 2 : 4);
  const int64_t grain = std::max<int64_t>(1, kMinWeightsPerTask / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    std::vector<int8_t> unpacked(int4 ? K : 0);
    int8_t* u = unpacked.data();
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = cp + n * width;
      const float* s = sp + n * G;
      void* o = op + n * out_row;
      if (int4 && bf16) dequantize_row<true, true>(row, width, s, K, group, u, o);
      else if (int4) dequantize_row<false, true>(row, width, s, K, group, u, o);
      else if (bf16) dequantize_row<true, false>(row, width, s, K, group, u, o);
      else dequantize_row<false, false>(row, width, s, K, group, u, o);
    }
  });
}

// Row n of the blocks' layout: its codes into `codes` [C * 128] (inputs past K are padding).
inline void unpack_block_row(const uint8_t* blocks, int64_t n, int64_t chunks, int8_t* codes) {
  const int64_t block = n / 4, r = n % 4;
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* words = blocks + ((block * chunks + c) * 4 + r) * 64;
    int8_t* out = codes + c * 128;
    for (int j = 0; j < 32; ++j) {
      const uint8_t lo = words[2 * j], hi = words[2 * j + 1];
      out[j] = int8_t(lo & 15) - 8;
      out[32 + j] = int8_t(lo >> 4) - 8;
      out[64 + j] = int8_t(hi & 15) - 8;
      out[96 + j] = int8_t(hi >> 4) - 8;
    }
  }
}

void dequantize_blocks(const at::Tensor& blocks, const at::Tensor& scales_in, int64_t K, const at::Tensor& out) {
  TORCH_CHECK(isa() != kNone, "decodekit kernels need AVX2 + FMA");
  TORCH_CHECK(blocks.dim() == 2 && blocks.device().is_cpu() && blocks.is_contiguous() &&
                  blocks.scalar_type() == at::kByte && blocks.size(0) % 4 == 0 && blocks.size(1) % 64 == 0 &&
                  blocks.size(1) * 2 >= K,
              "blocks must be a contiguous CPU uint8 [4j, width / 2] tensor (kernels.pack_int4_blocks)");
  const at::Tensor scales = scales_in.to(at::kFloat).contiguous();
  const int64_t N = scales.size(0), chunks = blocks.size(1) / 64;
  TORCH_CHECK(scales.dim() == 2 && N <= blocks.size(0) && scales.size(1) > 0 && K % scales.size(1) == 0,
              "scales must be [N, G] with N within the blocks' rows and G dividing K = ", K);
  const int64_t G = scales.size(1), group = K / G;
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  TORCH_CHECK(out.device().is_cpu() && (bf16 || out.scalar_type() == at::kFloat) && out.is_contiguous() &&
                  out.dim() == 2 && out.size(0) == N && out.size(1) == K,
              "out must be a contiguous CPU float32 or bfloat16 [", N, ", ", K, "] tensor");
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  char* op = static_cast<char*>(out.data_ptr());
  const int64_t out_row = K * (bf16 ? 2 : 4);
  const int64_t grain = std::max<int64_t>(1, kMinWeightsPerTask / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    std::vector<int8_t> codes(chunks * 128);
    for (int64_t n = n0; n < n1; ++n) {
      unpack_block_row(bp, n, chunks, codes.data());
      const uint8_t* row = reinterpret_cast<const uint8_t*>(codes.data());
      if (bf16) dequantize_row<true, false>(row, K, sp + n * G, K, group, nullptr, op + n * out_row);
      else dequantize_row<false, false>(row, K, sp + n * G, K, group, nullptr, op + n * out_row);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(decodekit, m) {
  m.def("dequantize(Tensor codes, Tensor scales, int in_features, Tensor(a!) out) -> ()");
  m.def("dequantize_blocks(Tensor blocks, Tensor scales, int in_features, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(decodekit, CPU, m) {
  m.impl("dequantize", &dequantize);
  m.impl("dequantize_blocks", &dequantize_blocks);
}
