// What decodekit's W8A8 / W4A8 kernels share (gemv_a8.cpp: the ops, x's quantisation and the
// GEMV; gemm_a8.cpp: the AVX2 W8A8 kernel for many x rows): the layout's constants, x quantised,
// and the AVX2 helpers whose operations both must repeat to give the same bits. Named
// (not anonymous) namespace: gemv_a8.cpp calls gemm_a8.cpp's `w8a8_rows_avx2`.
#pragma once

#include "gemv_common.h"

namespace decodekit_a8 {

constexpr int64_t kBlock = 32;  // inputs per activation scale (q8_0's block)
constexpr int64_t kLanes = 16;  // blocks per chunk: one int32 lane each

// x quantised: M rows of nbp blocks (whole chunks), the codes in the weights' step order.
struct QuantRows {
  const int8_t* q;   // [M, nbp * 32]
  const float* d;    // [M, nbp]: the blocks' scales (0 for an all-zero or padding block)
  const int32_t* c;  // [M, nbp]: the weight offset times the block's code sum
  int64_t nbp;
};

AVX2 inline float sum16_avx2(__m256 lo, __m256 hi) {  // sum16's tree over lanes 0-7 and 8-15
  const __m256 h = _mm256_add_ps(lo, hi);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

// 8 int32 lanes of a chunk's step: a plain load in a whole chunk, masked in the last one.
AVX2 inline __m256i load_lanes(const uint8_t* p, __m256i mask, bool whole) {
  return whole ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
               : _mm256_maskload_epi32(reinterpret_cast<const int*>(p), mask);
}

// gemm_a8.cpp: out[m * 4 + r] for `rows` x rows against a block of 4 int8 weight rows (W8A8),
// bit for bit what gemv_a8.cpp's a8_dot4_avx2 computes one x row at a time; `last`: the block
// is w's last (no read may pass its end).
void w8a8_rows_avx2(const uint8_t* wb, int64_t nb, const QuantRows& x, int64_t rows, const float* const* scales,
                    bool grouped, bool last, float* out);

}  // namespace decodekit_a8
