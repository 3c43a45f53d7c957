// decodekit's AVX2 kernel for W8A8 layers over many x rows (prefills, from kGemmMinRows rows;
// issue 39): gemv_a8.cpp's a8_dot4_avx2 for int8 weights, register-blocked over x rows.
//
// a8_dot4_avx2 runs int8 weights one x row at a time (llama.cpp's sign trick, maddubs(|q|,
// sign(w, q)), takes each x row's q apart), so every weight vector is loaded and offset once
// per x row. Here a tile is the block's 4 weight rows x 2 x rows: 8 int32 sums in registers
// while a chunk's 8 steps run, each weight vector loaded once for both x rows and each x
// vector (and its |q|) once for the 4 weight rows. The 16 float lanes of each output do not fit
// beside them, so each half of the lanes (a chunk's blocks 0-7, then 8-15) runs over all chunks
// on its own with its float sums in memory: a lane's sum does not depend on the other lanes', so
// each lane still performs the GEMV's operations in the GEMV's (chunk) order, and the halves
// then meet in sum16_avx2's tree. The integer block sums are exact in any order. So an x row's
// outputs have the same bits here as in a one-row call (tests/models/test_a8_prefill.py).
//
// At 128 rows on the Zen 3 (AVX2, one thread) this ran W8A8 at 0.76-0.97x PyTorch's float32
// GEMM against 0.56-0.72x for a8_dot4_avx2 (BENCHMARKS.md, 2026-11-28). The same register
// blocking did not help W4A8 (4 x 2, 2 x 4, 2 x 6, 4 x 3, 1 x 8 tiles: 0.9-1.6x F.linear against
// 1.5-1.9x for a8_dot4_avx2, which decodes each int4 vector once for 4 x rows already), so int4
// weights keep a8_dot4_avx2 at every row count.
#include "a8_layout.h"

namespace decodekit_a8 {
namespace {

constexpr int kTileX = 2;  // x rows per tile (4 weight rows): 8 int32 sums, 4 weight vectors, q, |q|

// How a tile reads its weight vectors: a whole half of a chunk (plain loads), a short one read
// past its bytes and masked with an AND, or (w's last block, where such a read could pass the
// end of w) vpmaskmovd. Only the last chunk of a row can be short.
enum Read { kWhole, kAnd, kMaskload };

template <Read READ>
AVX2 inline __m256i load_w(const uint8_t* p, __m256i mask) {
  if constexpr (READ == kMaskload) return _mm256_maskload_epi32(reinterpret_cast<const int*>(p), mask);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return READ == kWhole ? v : _mm256_and_si256(v, mask);
}

// Chunk c's half h (lanes: its blocks 8h .. 8h + 7, `mask` the real ones) of the block's 4 weight
// rows (`p`: the chunk's bytes) against MB x rows, added to acc[(r * MB + j) * 8 + lane].
template <bool GROUPED, int MB, Read READ>
AVX2 void chunk_half(const uint8_t* p, int64_t tb, int64_t c, const QuantRows& x, int h, const float* const* scales,
                     __m256i mask, float* acc) {
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(char(0x80));
  const int64_t step = 4 * tb, rb = 8 * step;  // a row's chunk: 8 steps of 4 bytes per block
  const int8_t* xq = x.q + c * kLanes * kBlock + 32 * h;  // x row j at xq + j * xs
  const int64_t xs = x.nbp * kBlock, at = c * kLanes + 8 * h;
  __m256i i[4][MB];
  UNROLL for (int r = 0; r < 4; ++r)
    UNROLL for (int j = 0; j < MB; ++j) i[r][j] = _mm256_setzero_si256();
  for (int s = 0; s < 8; ++s) {
    __m256i w[4];
    UNROLL for (int r = 0; r < 4; ++r) w[r] = _mm256_xor_si256(load_w<READ>(p + r * rb + 32 * h + s * step, mask), flip);
    UNROLL for (int j = 0; j < MB; ++j) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + j * xs + 64 * s));
      const __m256i aq = _mm256_abs_epi8(q);
      UNROLL for (int r = 0; r < 4; ++r) {
        const __m256i pairs = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(w[r], q));
        i[r][j] = _mm256_add_epi32(i[r][j], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  UNROLL for (int r = 0; r < 4; ++r) {
    __m256 s = _mm256_setzero_ps();
    if constexpr (GROUPED) {  // as a8_dot4_avx2 reads them
      const float* sc = scales[r] + at;
      s = READ == kWhole ? _mm256_loadu_ps(sc) : _mm256_maskload_ps(sc, mask);
    }
    UNROLL for (int j = 0; j < MB; ++j) {
      float* a = acc + (r * MB + j) * 8;
      const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(i[r][j]), _mm256_loadu_ps(x.d + j * x.nbp + at));
      _mm256_storeu_ps(a, GROUPED ? _mm256_fmadd_ps(f, s, _mm256_loadu_ps(a)) : _mm256_add_ps(_mm256_loadu_ps(a), f));
    }
  }
}

// Half h of the float sums of the block at wb (4 rows, layout of kernels.pack_a8_blocks) against
// MB x rows, over all chunks in order.
template <bool GROUPED, int MB>
AVX2 void half_tile(const uint8_t* wb, int64_t nb, const QuantRows& x, int h, const float* const* scales, bool last,
                    float* acc) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const uint8_t* p = wb;
  for (int64_t c = 0; c * kLanes < nb; ++c) {
    const int64_t tb = std::min(kLanes, nb - c * kLanes), lanes = tb - 8 * h;  // this half's blocks
    // An empty half (a last chunk of <= 8 blocks) would add +0.0 to each lane, which changes no
    // sum (a sum that starts at +0.0 and adds products never becomes -0.0).
    if (lanes <= 0) break;
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(lanes)), index);
    if (lanes >= 8) chunk_half<GROUPED, MB, kWhole>(p, tb, c, x, h, scales, mask, acc);
    else if (!last) chunk_half<GROUPED, MB, kAnd>(p, tb, c, x, h, scales, mask, acc);
    else chunk_half<GROUPED, MB, kMaskload>(p, tb, c, x, h, scales, mask, acc);
    p += 4 * 8 * 4 * tb;  // the block's 4 rows of 8 steps of 4 * tb bytes
  }
}

// out[j * 4 + r] for MB x rows: both halves to the end, then sum16_avx2's tree and the row
// scale, as a8_dot4_avx2 finishes.
template <bool GROUPED, int MB>
AVX2 void block_tile(const uint8_t* wb, int64_t nb, const QuantRows& x, const float* const* scales, bool last,
                     float* out) {
  alignas(32) float acc[2][4 * MB * 8] = {};  // [half][(r * MB + j) * 8 + lane]
  for (int h = 0; h < 2; ++h) half_tile<GROUPED, MB>(wb, nb, x, h, scales, last, acc[h]);
  for (int j = 0; j < MB; ++j)
    for (int r = 0; r < 4; ++r) {
      const int at = (r * MB + j) * 8;
      const float total = sum16_avx2(_mm256_load_ps(acc[0] + at), _mm256_load_ps(acc[1] + at));
      out[j * 4 + r] = GROUPED ? total : total * scales[r][0];
    }
}

template <bool GROUPED>
void block_rows(const uint8_t* wb, int64_t nb, const QuantRows& x, int64_t rows, const float* const* scales,
                bool last, float* out) {
  for (int64_t m = 0; m < rows; m += kTileX) {
    const QuantRows xm{x.q + m * x.nbp * kBlock, x.d + m * x.nbp, x.c + m * x.nbp, x.nbp};
    if (rows - m >= kTileX) block_tile<GROUPED, kTileX>(wb, nb, xm, scales, last, out + 4 * m);
    else block_tile<GROUPED, 1>(wb, nb, xm, scales, last, out + 4 * m);
  }
}

}  // namespace

void w8a8_rows_avx2(const uint8_t* wb, int64_t nb, const QuantRows& x, int64_t rows, const float* const* scales,
                    bool grouped, bool last, float* out) {
  if (grouped) block_rows<true>(wb, nb, x, rows, scales, last, out);
  else block_rows<false>(wb, nb, x, rows, scales, last, out);
}

}  // namespace decodekit_a8
