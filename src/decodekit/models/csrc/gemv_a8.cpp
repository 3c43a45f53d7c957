// decodekit's activation-quantised GEMV kernels (W8A8 and W4A8: the numerics of llama.cpp's
// q8_0 and q4_0 matmuls, REFERENCES.md "CPU peers and kernels"): y = x W^T (+ bias) with
// integer dot products.
//
//   decodekit::linear_w8a8   int8 weight codes (within ±127), one f32 scale per output row or
//                            per block of 32 inputs (a group of 64, 128, ... repeats its scale)
//   decodekit::linear_w4a8   int4 weight codes (within ±7), the same scales
//
// x: each row's blocks of 32 inputs (the last one zero padded) get one scale d = max|x| / 127
// and codes q = round(x * (1 / d)) (round half to even; q8_0's formula, which rounds half away:
// the two differ only on exact ties). Per block b of a weight row the integer dot product
// i_b = sum q w is exact in int32, and y = s * sum_b d_b i_b (one scale per row) or
// sum_b s_b d_b i_b (per-block weight scales).
//
// Weight layout (kernels.pack_a8_blocks): blocks of 4 weight rows one after another; inside
// one, chunks of 16 blocks (512 inputs; the last chunk holds the rest, tb <= 16 blocks), each of
// the 4 rows' chunk in turn. A row's chunk is 8 steps; step s holds, for each block j in turn,
// its inputs 32j + 4s .. 32j + 4s + 3, so one vpdpbusd adds 4 products into block j's int32
// lane and after the 8 steps lane j holds block j's whole dot product: no horizontal sums.
// int8 codes are stored + 128 (unsigned: vpdpbusd multiplies unsigned by signed bytes), int4
// codes + 8, steps 2t and 2t + 1 in the low and high nibbles of one 4-byte group. x is
// quantised into the same order, always whole chunks (zero padded). vpdpbusd computes
// sum (w + o) q = i_b + o * sum q, so o times each x block's code sum, computed once per x row,
// is subtracted. (vpdpbssd, signed by signed, is AVX-VNNI-INT8: absent on Zen 4 and Zen 5.)
// The AVX2 variant multiplies with maddubs and sums pairs with madd: |q| by sign(w, q) for
// int8 (llama.cpp's trick: pair sums stay below 2^15), the nibbles w + 8 by q for int4 (then
// the same correction), whose 8 steps' pair sums add up in int16 before one madd (each pair is
// at most 2 * 15 * 127 = 3,810 in magnitude, so 8 stay within 30,480). Both compute the same
// integers. The AVX2 variant decodes a block's int4 codes once for up to 4 x rows (2-16 rows
// at 0.6-0.8x the time of one x row at a time; int8 weights go one x row at a time, their sign
// trick being per row), loads a whole chunk's steps and block scales plainly (vpmaskmovd
// only in the last, partial chunk: with it everywhere, W4A8 ran at 1.9x the float32 kernel on
// the Zen 3, without 4.5x; W8A8 1.5x -> 2.8x. Plain scale loads and the int16 sums together:
// W4A8 in blocks of 32 at 0.81-0.85x the time at 1-2 x rows, per channel 0.96-0.99x,
// BENCHMARKS.md 2026-11-28) and prefetches ahead.
//
// The float part, per output (r, m) and lane j (block 16c + j), in chunk order: per row scale
// acc_j += float(i) * d_j, per block scales acc_j = fma(float(i) * d_j, s_j, acc_j); then the
// 16 lanes are summed in one fixed tree (`sum16`) and a row scale applied. Both instruction
// sets run exactly these operations, so they give the same bits, and each x row's result
// does not depend on how many rows share the call.
#include "a8_layout.h"

#include <cmath>

#define AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))

namespace {

using decodekit_a8::kBlock;
using decodekit_a8::kLanes;
using decodekit_a8::load_lanes;
using decodekit_a8::QuantRows;
using decodekit_a8::sum16_avx2;

bool wide_a8() {
  static const bool wide = [] {
    __builtin_cpu_init();
    return isa() == kAvx512 && __builtin_cpu_supports("avx512vnni");
  }();
  return wide;
}

// Bytes of one weight row in the kernel's layout, for nb blocks of inputs.
int64_t a8_row_bytes(int bits, int64_t nb) { return bits == 8 ? nb * kBlock : nb * kBlock / 2; }

// One block of n <= 32 inputs -> 32 codes, its scale and code sum (the two variants below
// compute the same numbers: abs and max are exact, x * id rounds once, cvtps rounds to even
// as nearbyint does in the default rounding mode).
void quantize_block(const float* x, int64_t n, int8_t* codes, float* d_out, int32_t* sum_out) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  int32_t sum = 0;
  for (int64_t i = 0; i < kBlock; ++i) {
    const int q = i < n ? std::min(127, std::max(-127, int(std::nearbyint(x[i] * id)))) : 0;
    codes[i] = int8_t(q);
    sum += q;
  }
  *d_out = d;
  *sum_out = sum;
}

AVX512_VNNI void quantize_block_avx512(const float* x, int64_t n, int8_t* codes, float* d_out, int32_t* sum_out) {
  const uint32_t mask = n >= 32 ? 0xFFFFFFFFu : (1u << n) - 1;
  const __m512 a = _mm512_maskz_loadu_ps(__mmask16(mask), x), b = _mm512_maskz_loadu_ps(__mmask16(mask >> 16), x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  const __m512 v = _mm512_set1_ps(id);
  const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
  const __m512i qa = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a, v)), hi), lo);
  const __m512i qb = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(b, v)), hi), lo);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 16), _mm512_cvtepi32_epi8(qb));
  *d_out = d;
  *sum_out = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}

// AVX2: the same numbers as `quantize_block` for a whole block (abs by clearing the sign bit, the
// maximum exact in any order, cvtps rounding to even as nearbyint does); a last, partial block
// takes the scalar loop. (The scalar loop's nearbyint call per input cost ~50 us at K = 4,864
// on the Zen 3, a third of a W4A8 4,864 -> 896 layer's weights.)
AVX2 void quantize_block_avx2(const float* x, int64_t n, int8_t* codes, float* d_out, int32_t* sum_out) {
  if (n < kBlock) return quantize_block(x, n, codes, d_out, sum_out);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  const __m256 scale = _mm256_set1_ps(id);
  const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
  __m256i q[4], total = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    q[j] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[j], scale)), hi), lo);
    total = _mm256_add_epi32(total, q[j]);
  }
  // int32 -> int8 in input order: packs interleave the 128-bit lanes, the permute restores them.
  const __m256i w16 = _mm256_packs_epi32(q[0], q[1]), w16b = _mm256_packs_epi32(q[2], q[3]);
  const __m256i b8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16, w16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), b8);
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  *d_out = d;
  *sum_out = _mm_cvtsi128_si32(s);
}

// x [M, K] f32 -> the QuantRows buffers (zeroed by the caller); `offset` is 128 (int8
// weights) or 8 (int4).
void quantize_rows(const float* x, int64_t M, int64_t K, int32_t offset, int8_t* q, float* d, int32_t* c,
                   int64_t nbp) {
  const int64_t nb = (K + kBlock - 1) / kBlock;
  const bool wide = wide_a8();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      int8_t codes[kBlock];
      int32_t sum;
      const int64_t n = std::min(kBlock, K - b * kBlock);
      const float* xb = x + m * K + b * kBlock;
      if (wide)
        quantize_block_avx512(xb, n, codes, d + m * nbp + b, &sum);
      else
        quantize_block_avx2(xb, n, codes, d + m * nbp + b, &sum);
      c[m * nbp + b] = offset * sum;
      int8_t* chunk = q + m * nbp * kBlock + (b / kLanes) * kLanes * kBlock;
      for (int s = 0; s < 8; ++s) std::memcpy(chunk + 64 * s + 4 * (b % kLanes), codes + 4 * s, 4);
    }
}

// ---------------------------------------------------------------- AVX-512 VNNI --------

AVX512_VNNI inline float sum16(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

// out[m * 4 + r] for a block of 4 weight rows and MB <= 4 rows of x (rows past the weight
// block's end repeat its last row's scales; the caller does not store them).
template <int BITS, int MB, bool GROUPED>
AVX512_VNNI void a8_dot4_avx512(const uint8_t* wb, int64_t nb, const QuantRows& x, const float* const* scales,
                                int64_t ahead, float* out) {
  __m512 acc[4][MB];
  UNROLL for (int r = 0; r < 4; ++r)
    UNROLL for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint8_t* p = wb;
  for (int64_t c = 0; c * kLanes < nb; ++c) {
    const int64_t tb = std::min(kLanes, nb - c * kLanes);
    const __mmask16 lanes = __mmask16((1u << tb) - 1);
    const int64_t step = 4 * tb, rb = (BITS == 8 ? 8 : 4) * step;  // a row's chunk: rb bytes
    UNROLL for (int r = 0; r < 4; ++r) {
      const uint8_t* wr = p + r * rb;
      if (ahead)
        for (int64_t o = 0; o < rb; o += 64) _mm_prefetch(reinterpret_cast<const char*>(wr + ahead + o), _MM_HINT_T0);
      __m512i w[8];
      if constexpr (BITS == 8) {
        UNROLL for (int s = 0; s < 8; ++s) w[s] = _mm512_maskz_loadu_epi32(lanes, wr + s * step);
      } else {
        UNROLL for (int t = 0; t < 4; ++t) {
          const __m512i v = _mm512_maskz_loadu_epi32(lanes, wr + t * step);
          w[2 * t] = _mm512_and_si512(v, low4);
          w[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
      }
      const __m512 s = GROUPED ? _mm512_maskz_loadu_ps(lanes, scales[r] + c * kLanes) : _mm512_setzero_ps();
      UNROLL for (int m = 0; m < MB; ++m) {
        const int8_t* xq = x.q + m * x.nbp * kBlock + c * kLanes * kBlock;
        __m512i i = _mm512_setzero_si512();
        UNROLL for (int t = 0; t < 8; ++t) i = _mm512_dpbusd_epi32(i, w[t], _mm512_loadu_si512(xq + 64 * t));
        const int64_t at = m * x.nbp + c * kLanes;
        i = _mm512_sub_epi32(i, _mm512_loadu_si512(x.c + at));
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(i), _mm512_loadu_ps(x.d + at));
        acc[r][m] = GROUPED ? _mm512_fmadd_ps(f, s, acc[r][m]) : _mm512_add_ps(acc[r][m], f);
      }
    }
    p += 4 * rb;
  }
  UNROLL for (int m = 0; m < MB; ++m)
    UNROLL for (int r = 0; r < 4; ++r) {
      const float total = sum16(acc[r][m]);
      out[m * 4 + r] = GROUPED ? total : total * scales[r][0];
    }
}

template <int BITS, bool GROUPED>
void a8_rows_avx512(int64_t mb, const uint8_t* wb, int64_t nb, const QuantRows& x, const float* const* scales,
                    int64_t ahead, float* out) {
  if (mb == 4) a8_dot4_avx512<BITS, 4, GROUPED>(wb, nb, x, scales, ahead, out);
  else if (mb == 3) a8_dot4_avx512<BITS, 3, GROUPED>(wb, nb, x, scales, ahead, out);
  else if (mb == 2) a8_dot4_avx512<BITS, 2, GROUPED>(wb, nb, x, scales, ahead, out);
  else a8_dot4_avx512<BITS, 1, GROUPED>(wb, nb, x, scales, ahead, out);
}

// ---------------------------------------------------------------- AVX2 ----------------

// MB x rows (from m) against a block of 4 weight rows: the AVX-512 kernel's operations, each
// 16-lane vector as two halves; the int4 nibbles are decoded once for the MB rows.
template <int BITS, bool GROUPED, int MB>
AVX2 void a8_dot4_avx2(const uint8_t* wb, int64_t nb, const QuantRows& x, int64_t m, const float* const* scales,
                       int64_t ahead, float* out) {
  __m256 acc[4][2][MB];
  UNROLL for (int r = 0; r < 4; ++r)
    UNROLL for (int h = 0; h < 2; ++h)
      UNROLL for (int j = 0; j < MB; ++j) acc[r][h][j] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(char(0x80));
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const uint8_t* p = wb;
  for (int64_t c = 0; c * kLanes < nb; ++c) {
    const int64_t tb = std::min(kLanes, nb - c * kLanes);
    const int64_t step = 4 * tb, rb = (BITS == 8 ? 8 : 4) * step;
    const __m256i mask[2] = {_mm256_cmpgt_epi32(_mm256_set1_epi32(int(tb)), index),
                             _mm256_cmpgt_epi32(_mm256_set1_epi32(int(tb) - 8), index)};
    const bool whole = tb == kLanes;
    const int8_t* xq[MB];
    int64_t at[MB];
    UNROLL for (int j = 0; j < MB; ++j) {
      xq[j] = x.q + (m + j) * x.nbp * kBlock + c * kLanes * kBlock;
      at[j] = (m + j) * x.nbp + c * kLanes;
    }
    for (int r = 0; r < 4; ++r) {
      const uint8_t* wr = p + r * rb;
      if (ahead)
        for (int64_t o = 0; o < rb; o += 64) _mm_prefetch(reinterpret_cast<const char*>(wr + ahead + o), _MM_HINT_T0);
      UNROLL for (int h = 0; h < 2; ++h) {
        __m256i i[MB];
        const uint8_t* wh = wr + 32 * h;
        if constexpr (BITS == 8) {
          UNROLL for (int j = 0; j < MB; ++j) {
            i[j] = _mm256_setzero_si256();
            for (int t = 0; t < 8; ++t) {
              const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[j] + 32 * h + 64 * t));
              const __m256i w = _mm256_xor_si256(load_lanes(wh + t * step, mask[h], whole), flip);
              const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(w, q));
              i[j] = _mm256_add_epi32(i[j], _mm256_madd_epi16(pairs, ones));
            }
          }
        } else {
          __m256i pairs[MB];
          UNROLL for (int j = 0; j < MB; ++j) pairs[j] = _mm256_setzero_si256();
          UNROLL for (int t = 0; t < 4; ++t) {
            const __m256i v = load_lanes(wh + t * step, mask[h], whole);
            const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            UNROLL for (int j = 0; j < MB; ++j) {
              const __m256i* xh = reinterpret_cast<const __m256i*>(xq[j] + 32 * h + 128 * t);  // steps 2t, 2t + 1
              pairs[j] = _mm256_add_epi16(pairs[j], _mm256_maddubs_epi16(lo, _mm256_loadu_si256(xh)));
              pairs[j] = _mm256_add_epi16(pairs[j], _mm256_maddubs_epi16(hi, _mm256_loadu_si256(xh + 2)));
            }
          }
          UNROLL for (int j = 0; j < MB; ++j)
            i[j] = _mm256_sub_epi32(_mm256_madd_epi16(pairs[j], ones),
                                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.c + at[j] + 8 * h)));
        }
        __m256 s = _mm256_setzero_ps();
        if constexpr (GROUPED) {
          const float* sc = scales[r] + c * kLanes + 8 * h;
          s = whole ? _mm256_loadu_ps(sc) : _mm256_maskload_ps(sc, mask[h]);
        }
        UNROLL for (int j = 0; j < MB; ++j) {
          const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(i[j]), _mm256_loadu_ps(x.d + at[j] + 8 * h));
          acc[r][h][j] = GROUPED ? _mm256_fmadd_ps(f, s, acc[r][h][j]) : _mm256_add_ps(acc[r][h][j], f);
        }
      }
    }
    p += 4 * rb;
  }
  UNROLL for (int j = 0; j < MB; ++j)
    for (int r = 0; r < 4; ++r) {
      const float total = sum16_avx2(acc[r][0][j], acc[r][1][j]);
      out[j * 4 + r] = GROUPED ? total : total * scales[r][0];
    }
}

// The x block's mb <= 4 rows: int4 codes decoded once for all of them (a8_dot4_avx2's MB),
// int8 weights one x row at a time (their sign trick takes each row's q apart; the x rows after
// the first read the block from the cache).
template <int BITS, bool GROUPED>
void a8_rows_avx2(int64_t mb, const uint8_t* wb, int64_t nb, const QuantRows& x, const float* const* scales,
                  int64_t ahead, float* out) {
  if constexpr (BITS == 4) {
    if (mb == 4) a8_dot4_avx2<BITS, GROUPED, 4>(wb, nb, x, 0, scales, ahead, out);
    else if (mb == 3) a8_dot4_avx2<BITS, GROUPED, 3>(wb, nb, x, 0, scales, ahead, out);
    else if (mb == 2) a8_dot4_avx2<BITS, GROUPED, 2>(wb, nb, x, 0, scales, ahead, out);
    else a8_dot4_avx2<BITS, GROUPED, 1>(wb, nb, x, 0, scales, ahead, out);
  } else {
    for (int64_t m = 0; m < mb; ++m)
      a8_dot4_avx2<BITS, GROUPED, 1>(wb, nb, x, m, scales, m == 0 ? ahead : 0, out + 4 * m);
  }
}

// ---------------------------------------------------------------- ops -----------------

// x rows per panel: their quantised codes, scales and sums (40 bytes a block) fit this.
constexpr int64_t kPanelBytes = 256 << 10;
// Rows from which W8A8 on AVX2 runs gemm_a8.cpp's tiles: at 8 rows a8_dot4_avx2 was 1.1x faster
// (896 -> 4,864), at 16 and 32 rows the tiles 1.0-1.1x (BENCHMARKS.md, 2026-11-28).
constexpr int64_t kW8A8TileRows = 16;

// w: uint8 [ceil(N / 4) * 4, a8_row_bytes] as kernels.pack_a8_blocks lays it out; scales: f32
// [N, 1] or [N, ceil(K / 32)].
template <int BITS>
at::Tensor linear_a8_2d(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& scales_in,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(isa() != kNone, "decodekit GEMV kernels need AVX2 + FMA");
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2, "x must be a CPU [M, K] tensor");
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const int64_t nb = (K + kBlock - 1) / kBlock, nbp = (nb + kLanes - 1) / kLanes * kLanes;
  const int64_t row_bytes = a8_row_bytes(BITS, nb);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu() &&
                  w.size(0) % 4 == 0 && w.size(1) == row_bytes,
              "w must be a contiguous CPU uint8 [4j, ", row_bytes, "] tensor (kernels.pack_a8_blocks) for ", K,
              " inputs");
  const at::Tensor s = scales_in.to(at::kFloat).contiguous();
  const int64_t N = s.size(0);
  TORCH_CHECK(s.dim() == 2 && (s.size(1) == 1 || s.size(1) == nb) && (N + 3) / 4 * 4 == w.size(0),
              "scales must be [N, 1] or [N, ceil(K / 32)], with w holding ceil(N / 4) * 4 rows");
  const bool grouped = s.size(1) > 1, wide = wide_a8();
  const at::Tensor xf = x_in.to(at::kFloat).contiguous();
  // One zeroed buffer (one allocation a call): codes [M, nbp * 32], then scales and sums [M, nbp].
  at::Tensor buffer = at::zeros({M * nbp * (kBlock + 8)}, at::kByte);
  int8_t* q = reinterpret_cast<int8_t*>(buffer.data_ptr<uint8_t>());
  float* d = reinterpret_cast<float*>(q + M * nbp * kBlock);
  int32_t* c = reinterpret_cast<int32_t*>(d + M * nbp);
  quantize_rows(xf.data_ptr<float>(), M, K, BITS == 8 ? 128 : 8, q, d, c, nbp);
  at::Tensor y = at::empty({M, N}, xf.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = s.data_ptr<float>();
  const int64_t G = s.size(1), blocks = (N + 3) / 4, block_bytes = 4 * row_bytes;
  const int64_t grain = std::max<int64_t>(1, kMinWeightsPerTask / (4 * std::max<int64_t>(K, 1)));
  // From kW8A8TileRows rows, int8 weights on AVX2 take gemm_a8.cpp's register-blocked kernel.
  const bool tiled = BITS == 8 && !wide && M >= kW8A8TileRows;
  // Panels of x rows whose quantised codes stay in L2 while every weight block runs over them
  // (a prefill's x at K = 4,864 is ~1 MB: read from L3 per weight block without them).
  const int64_t panel = std::max<int64_t>(4, kPanelBytes / (nbp * (kBlock + 8)) / 4 * 4);
  for (int64_t p0 = 0; p0 < M; p0 += panel) {
    const int64_t p1 = std::min(M, p0 + panel);
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * 4, rows = std::min<int64_t>(4, N - n0);
        const uint8_t* wb = wp + b * block_bytes;
        const float* sr[4];
        block_scale_rows(sp, n0, rows, G, sr);
        for (int64_t m0 = p0; m0 < p1; m0 += 4) {
          const int64_t mb = std::min<int64_t>(4, p1 - m0);
          float out[16];
          const QuantRows xm{q + m0 * nbp * kBlock, d + m0 * nbp, c + m0 * nbp, nbp};
          const int64_t ahead = m0 == p0 ? kAheadBytes : 0;  // later x blocks hit the cache
          if (tiled) {
            decodekit_a8::w8a8_rows_avx2(wb, nb, xm, mb, sr, grouped, b == blocks - 1, out);
          } else if (!wide) {
            if (grouped) a8_rows_avx2<BITS, true>(mb, wb, nb, xm, sr, ahead, out);
            else a8_rows_avx2<BITS, false>(mb, wb, nb, xm, sr, ahead, out);
          } else if (grouped) {
            a8_rows_avx512<BITS, true>(mb, wb, nb, xm, sr, ahead, out);
          } else {
            a8_rows_avx512<BITS, false>(mb, wb, nb, xm, sr, ahead, out);
          }
          for (int64_t m = 0; m < mb; ++m)
            for (int64_t r = 0; r < rows; ++r) yp[(m0 + m) * N + n0 + r] = out[m * 4 + r];
        }
      }
    });
  }
  return finish(y, bias, x_in.scalar_type());
}

at::Tensor linear_w8a8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias) {
  return like_rows(linear_a8_2d<8>(as_rows(x), w, scales, bias), x);
}

at::Tensor linear_w4a8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias) {
  return like_rows(linear_a8_2d<4>(as_rows(x), w, scales, bias), x);
}

int64_t a8_isa() { return isa() == kNone ? kNone : (wide_a8() ? kAvx512 : kAvx2); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(decodekit, m) {
  m.def("a8_isa() -> int", &a8_isa);
  m.def("linear_w8a8(Tensor x, Tensor w, Tensor scales, Tensor? bias) -> Tensor");
  m.def("linear_w4a8(Tensor x, Tensor w, Tensor scales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(decodekit, CPU, m) {
  m.impl("linear_w8a8", &linear_w8a8);
  m.impl("linear_w4a8", &linear_w4a8);
}
