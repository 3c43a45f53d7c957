// decodekit's CPU GEMV kernels for a few rows (batch-1 decode): y = x W^T (+ bias).
//
// Decode at batch 1 is a matrix-vector product bound by how fast the weights stream from
// memory (REFERENCES.md, "CPU peers and kernels"), so each kernel reads every weight byte
// once, in address order, and does the arithmetic in registers:
//
//   decodekit::linear_t      f32/bf16/f16 weights stored transposed, wt [K, N] contiguous
//                            (the layout models/native.py keeps for float32):
//                            y[m] += x[m, k] wt[k] over 4 rows of wt at a time, y's slice
//                            staying in L1 (measured fastest for f32; bf16 reads faster
//                            row-major, below, so native.py keeps bf16 weights row-major);
//                            the inputs in two fixed halves summed apart (axpy_kernel).
//   decodekit::linear_rows   row-major weights w [N, K] of f32, bf16, f16 or int8 (one f32
//                            scale per row or per group of `group` inputs): 4 rows' dot
//                            products with x in f32, weights widened to f32 in registers,
//                            short rows prefetched as one stream per block of 4 rows, long
//                            ones a stream per row; bf16 weights with bf16
//                            x (a bfloat16 model) one row at a time by vdpbf16ps instead
//                            (dot_bf16_avx512; AVX-512 only, the AVX2 variant widens x).
//   (decodekit::linear_int4, the weight-only int4 op, is gemv_int4.cpp.)
//
// The AVX-512 kernels decode each weight block once for up to 4 rows of x (dot4_avx512), so
// 2-64 rows (batched decoding, speculative verification) cost far less than as many
// single-row calls.
//
// Each has an AVX-512 (F/BW/VL/DQ; BF16 for the bf16 x bf16 kernel) and an AVX2 + FMA variant,
// picked once by the CPU's instructions (gemv_common.h; DECODEKIT_GEMV_ISA=avx2 forces the
// second, for tests; linear_t's and linear_rows' (f32 x) two variants return the same bits:
// the AVX2 row kernel keeps the AVX-512 one's 16 lanes as two halves, dotr_avx2), and runs in
// parallel over blocks of outputs (at::parallel_for; the transposed f32 kernel over fixed
// halves of the inputs too), so each output is summed in one fixed order whatever the thread
// count.
#include "gemv_common.h"

namespace {

enum class WT { F32, BF16, F16, I8 };

template <WT T>
inline float load1(const void* p, int64_t k) {
  if constexpr (T == WT::F32) return static_cast<const float*>(p)[k];
  if constexpr (T == WT::BF16) return bf16_to_float(static_cast<const uint16_t*>(p)[k]);
  if constexpr (T == WT::F16) return float(static_cast<const c10::Half*>(p)[k]);
  if constexpr (T == WT::I8) return float(static_cast<const int8_t*>(p)[k]);
}

// ---------------------------------------------------------------- AVX-512 -------------

template <WT T>
AVX512 inline __m512 load16(const void* p, int64_t k) {
  if constexpr (T == WT::F32) return _mm512_loadu_ps(static_cast<const float*>(p) + k);
  if constexpr (T == WT::BF16) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + k));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  if constexpr (T == WT::F16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + k)));
  }
  if constexpr (T == WT::I8) {
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(p) + k));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
}

template <WT T>
AVX512 inline __m512 load16_mask(const void* p, int64_t k, __mmask16 m) {
  if constexpr (T == WT::F32) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + k);
  if constexpr (T == WT::BF16) {
    __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  if constexpr (T == WT::F16) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + k));
  if constexpr (T == WT::I8) {
    __m128i b = _mm_maskz_loadu_epi8(m, static_cast<const int8_t*>(p) + k);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
}

constexpr int64_t elem_bytes(WT T) { return T == WT::F32 ? 4 : T == WT::I8 ? 1 : 2; }

// out[m * 4 + r] = sum_g scale[r, g] * (w[r, group g] . x[m, group g]) for a block of 4 weight
// rows and MB <= 4 rows of x: each weight step is widened once and
// used for every x row (rows past the block's end repeat its last row and are not stored by
// the caller). Each (r, m) sum runs the same operations in the same order whatever MB, so a
// row's result never depends on how many rows share the call. (A second accumulator for a lone
// row, as the first kernels had, measured no faster once the prefetch reached 8 KiB ahead.)
template <WT T, int MB, bool OneStream>
AVX512 void dot4_avx512(const char* const* w, const float* x, int64_t K,
                        const float* const* scales, int64_t group, int64_t ahead, float* out) {
  __m512 tot[4][MB], acc[4][MB];
  UNROLL for (int r = 0; r < 4; ++r)
    UNROLL for (int m = 0; m < MB; ++m) tot[r][m] = _mm512_setzero_ps();
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, ++g) {
    const int64_t k1 = std::min(K, k0 + group);
    UNROLL for (int r = 0; r < 4; ++r)
      UNROLL for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
    int64_t k = k0;
    for (; k + 32 <= k1; k += 32) {
      if (OneStream && ahead) {  // one ascending stream over the block's 4 rows (dotr_avx2's comment)
        const char* pf = w[0] + ahead + k * 4 * elem_bytes(T);
        UNROLL for (int o = 0; o < 4 * 32 * elem_bytes(T); o += 64) _mm_prefetch(pf + o, _MM_HINT_T0);
      }
      UNROLL for (int r = 0; r < 4; ++r) {
        if (!OneStream && ahead) {  // each row's own stream, `ahead` bytes on
          const char* a = w[r] + k * elem_bytes(T) + ahead;
          _mm_prefetch(a, _MM_HINT_T0);
          if constexpr (T == WT::F32) _mm_prefetch(a + 64, _MM_HINT_T0);
        }
        const __m512 w0 = load16<T>(w[r], k), w1 = load16<T>(w[r], k + 16);
        UNROLL for (int m = 0; m < MB; ++m) {
          const float* xm = x + m * K + k;
          acc[r][m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xm), acc[r][m]);
          acc[r][m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm + 16), acc[r][m]);
        }
      }
    }
    if (k < k1) {  // up to 31 inputs left: lanes past k1 read as zeros
      const __mmask32 mask = __mmask32((1u << (k1 - k)) - 1);
      UNROLL for (int r = 0; r < 4; ++r) {
        const __m512 w0 = load16_mask<T>(w[r], k, __mmask16(mask)), w1 = load16_mask<T>(w[r], k + 16, __mmask16(mask >> 16));
        UNROLL for (int m = 0; m < MB; ++m) {
          const float* xm = x + m * K + k;
          __m512 x0 = _mm512_maskz_loadu_ps(__mmask16(mask), xm), x1 = _mm512_maskz_loadu_ps(__mmask16(mask >> 16), xm + 16);
          acc[r][m] = _mm512_fmadd_ps(w0, x0, acc[r][m]);
          acc[r][m] = _mm512_fmadd_ps(w1, x1, acc[r][m]);
        }
      }
    }
    UNROLL for (int r = 0; r < 4; ++r)
      UNROLL for (int m = 0; m < MB; ++m) {
        tot[r][m] = scales ? _mm512_fmadd_ps(acc[r][m], _mm512_set1_ps(scales[r][g]), tot[r][m])
                           : _mm512_add_ps(tot[r][m], acc[r][m]);
      }
  }
  UNROLL for (int m = 0; m < MB; ++m)
    UNROLL for (int r = 0; r < 4; ++r) out[m * 4 + r] = _mm512_reduce_add_ps(tot[r][m]);
}

template <WT T, bool OneStream>
void dot4_avx512_rows(int64_t mb, const char* const* w, const float* x, int64_t K, const float* const* scales,
                      int64_t group, int64_t ahead, float* out) {
  if (mb == 4) dot4_avx512<T, 4, OneStream>(w, x, K, scales, group, ahead, out);
  else if (mb == 3) dot4_avx512<T, 3, OneStream>(w, x, K, scales, group, ahead, out);
  else if (mb == 2) dot4_avx512<T, 2, OneStream>(w, x, K, scales, group, ahead, out);
  else dot4_avx512<T, 1, OneStream>(w, x, K, scales, group, ahead, out);
}

// bfloat16 weights times bfloat16 x (a bfloat16 model's activations are bfloat16 already):
// out[m] = w . x[m] for one weight row w [K] and MB <= 4 rows of x [MB, K], by vdpbf16ps: one
// 64-byte load of 32 weights and one instruction per x row, where dot4_avx512 widens to f32
// and runs two FMAs. Each bf16 product is exact in f32; the instruction adds a lane's two
// products into its f32 sum rounding to nearest even, with denormal inputs and results
// flushed to zero, so sums can differ from the FMA kernel's in their last bits (tests allow
// for it). One row at a time reads the weights as one sequential stream: 896 -> 4864 ran 249
// against 4 interleaved rows' 327 us (BENCHMARKS.md, 2026-11-25). Four accumulators per x row
// (inputs k mod 128 in 32s) hide the instruction's latency; each x row's sum is its own chain,
// so a row's result does not depend on MB.
template <int MB>
AVX512_BF16 void dot_bf16_avx512(const uint16_t* w, const uint16_t* x, int64_t K, int64_t ahead, float* out) {
  __m512 acc[MB][4];
  UNROLL for (int m = 0; m < MB; ++m)
    UNROLL for (int a = 0; a < 4; ++a) acc[m][a] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 128 <= K; k += 128) {
    if (ahead) {
      _mm_prefetch(reinterpret_cast<const char*>(w + k) + ahead, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + k) + ahead + 64, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + k) + ahead + 128, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + k) + ahead + 192, _MM_HINT_T0);
    }
    UNROLL for (int a = 0; a < 4; ++a) {
      const __m512bh wr = (__m512bh)_mm512_loadu_si512(w + k + 32 * a);
      UNROLL for (int m = 0; m < MB; ++m)
        acc[m][a] = _mm512_dpbf16_ps(acc[m][a], wr, (__m512bh)_mm512_loadu_si512(x + m * K + k + 32 * a));
    }
  }
  for (int a = 0; k < K; k += 32, ++a) {
    const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : __mmask32((1u << (K - k)) - 1);
    const __m512bh wr = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k);
    UNROLL for (int m = 0; m < MB; ++m)
      acc[m][a] = _mm512_dpbf16_ps(acc[m][a], wr, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k));
  }
  UNROLL for (int m = 0; m < MB; ++m)
    out[m] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3])));
}

// y[m, n0:n1] = x[m] wt[:, n0:n1] for wt [K, N] row-major (the transposed weight): four
// rows of wt at a time, each a long contiguous stream, into y's slice held in L1.
template <WT T>
AVX512 void axpy_avx512(const char* wt, int64_t K, int64_t N, const float* x, int64_t M, float* y,
                        int64_t n0, int64_t n1, int64_t k0, int64_t k1) {
  for (int64_t m = 0; m < M; ++m) std::memset(y + m * N + n0, 0, (n1 - n0) * sizeof(float));
  const int64_t full = n0 + (n1 - n0) / 16 * 16;
  const __mmask16 tail = __mmask16((1u << ((n1 - n0) % 16)) - 1);
  const int64_t row = N * elem_bytes(T);
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    const char *w0 = wt + k * row, *w1 = w0 + row, *w2 = w1 + row, *w3 = w2 + row;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K + k;
      __m512 x0 = _mm512_set1_ps(xm[0]), x1 = _mm512_set1_ps(xm[1]);
      __m512 x2 = _mm512_set1_ps(xm[2]), x3 = _mm512_set1_ps(xm[3]);
      float* ym = y + m * N;
      int64_t n = n0;
      for (; n < full; n += 16) {
        __m512 acc = _mm512_loadu_ps(ym + n);
        acc = _mm512_fmadd_ps(load16<T>(w0, n), x0, acc);
        acc = _mm512_fmadd_ps(load16<T>(w1, n), x1, acc);
        acc = _mm512_fmadd_ps(load16<T>(w2, n), x2, acc);
        acc = _mm512_fmadd_ps(load16<T>(w3, n), x3, acc);
        _mm512_storeu_ps(ym + n, acc);
      }
      if (tail) {
        __m512 acc = _mm512_maskz_loadu_ps(tail, ym + n);
        acc = _mm512_fmadd_ps(load16_mask<T>(w0, n, tail), x0, acc);
        acc = _mm512_fmadd_ps(load16_mask<T>(w1, n, tail), x1, acc);
        acc = _mm512_fmadd_ps(load16_mask<T>(w2, n, tail), x2, acc);
        acc = _mm512_fmadd_ps(load16_mask<T>(w3, n, tail), x3, acc);
        _mm512_mask_storeu_ps(ym + n, tail, acc);
      }
    }
  }
  for (; k < k1; ++k) {
    const char* w0 = wt + k * row;
    for (int64_t m = 0; m < M; ++m) {
      __m512 x0 = _mm512_set1_ps(x[m * K + k]);
      float* ym = y + m * N;
      int64_t n = n0;
      for (; n < full; n += 16)
        _mm512_storeu_ps(ym + n, _mm512_fmadd_ps(load16<T>(w0, n), x0, _mm512_loadu_ps(ym + n)));
      if (tail)
        _mm512_mask_storeu_ps(ym + n, tail,
                              _mm512_fmadd_ps(load16_mask<T>(w0, n, tail), x0, _mm512_maskz_loadu_ps(tail, ym + n)));
    }
  }
}

// ---------------------------------------------------------------- AVX2 ----------------

template <WT T>
AVX2 inline __m256 load8(const void* p, int64_t k) {
  if constexpr (T == WT::F32) return _mm256_loadu_ps(static_cast<const float*>(p) + k);
  if constexpr (T == WT::BF16) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  if constexpr (T == WT::F16) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + k)));
  if constexpr (T == WT::I8) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(p) + k));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
}

// n < 8 elements from k, widened to f32 in 8 lanes, zeros past n (a group's last steps).
template <WT T>
AVX2 inline __m256 load8_part(const void* p, int64_t k, int64_t n) {
  alignas(32) float part[8] = {};
  for (int64_t j = 0; j < n; ++j) part[j] = load1<T>(p, k + j);
  return _mm256_load_ps(part);
}

// The AVX2 dot4_avx512, in its order, so both variants return the same bits (issue 39):
// out[m * R + r] = sum_g scale[r, g] (w[r, group g] . x[m, group g]) for R weight rows and MB
// x rows. Each (r, m) sum keeps dot4_avx512's 16 lanes as two 8-lane halves (lane j: inputs
// k0 + j, k0 + 16 + j, ... of group k0), runs one FMA per input in the same order per lane (the
// AVX-512 tail's masked lanes add 0 x 0, which leaves a sum unchanged), scales each group's
// sums into tot the same way, and adds the 16 lanes in _mm512_reduce_add_ps's order (the two
// halves, then hsum256's tree, which is GCC's reduction). Weights are widened exactly, so
// f32, bf16, f16 and int8 rows all match. dot4_avx2 runs R = 4 rows for one x row and two
// passes of R = 2 for two (16 chains would spill). The R rows lie one after another in memory,
// and each step of 16 inputs prefetches the next R * 16 elements' worth of lines of that span,
// `ahead` bytes on: one ascending stream (the rows are short streams the hardware prefetcher
// does not ramp up on; one prefetch stream per row, 4 interleaved, ran int8 896 -> 4864 at
// 1.3-1.5x the time on the Zen 3 and bf16 rows at 1.25-1.5x, BENCHMARKS.md 2026-11-28). On the
// Zen 3, one x row, against the float32 kernel: int8 per channel 1.5 -> 1.7x at 896 -> 9728 and
// 2.4x at 4864 -> 896, int8 in groups of 64 1.0 -> 1.5x and 1.9x (8 lanes), before that change.
template <WT T, int R, int MB>
AVX2 void dotr_avx2(const char* const* w, const float* x, int64_t K, const float* const* scales, int64_t group,
                    int64_t ahead, float* out) {
  constexpr int step_bytes = R * 16 * elem_bytes(T);  // weight bytes per step of 16 inputs
  float tot[R][MB][16] = {};
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, ++g) {
    const int64_t k1 = std::min(K, k0 + group);
    __m256 lo[R][MB], hi[R][MB];
    UNROLL for (int r = 0; r < R; ++r)
      UNROLL for (int m = 0; m < MB; ++m) lo[r][m] = hi[r][m] = _mm256_setzero_ps();
    int64_t k = k0;
    for (; k + 16 <= k1; k += 16) {
      if (ahead) {  // the lines R * 16 elements cover, `ahead` bytes on from the block's start
        const char* pf = w[0] + ahead + k * R * elem_bytes(T);
        UNROLL for (int o = 0; o < step_bytes; o += 64) _mm_prefetch(pf + o, _MM_HINT_T0);
      }
      __m256 xl[MB], xh[MB];
      UNROLL for (int m = 0; m < MB; ++m) {
        xl[m] = _mm256_loadu_ps(x + m * K + k);
        xh[m] = _mm256_loadu_ps(x + m * K + k + 8);
      }
      UNROLL for (int r = 0; r < R; ++r) {
        const __m256 wl = load8<T>(w[r], k), wh = load8<T>(w[r], k + 8);
        UNROLL for (int m = 0; m < MB; ++m) {
          lo[r][m] = _mm256_fmadd_ps(wl, xl[m], lo[r][m]);
          hi[r][m] = _mm256_fmadd_ps(wh, xh[m], hi[r][m]);
        }
      }
    }
    if (k < k1) {  // up to 15 inputs left: lanes past k1 read as zeros
      const int64_t nl = std::min<int64_t>(8, k1 - k), nh = k1 - k - nl;
      __m256 xl[MB], xh[MB];
      UNROLL for (int m = 0; m < MB; ++m) {
        xl[m] = load8_part<WT::F32>(x + m * K, k, nl);
        xh[m] = load8_part<WT::F32>(x + m * K, k + 8, nh);
      }
      UNROLL for (int r = 0; r < R; ++r) {
        const __m256 wl = load8_part<T>(w[r], k, nl), wh = load8_part<T>(w[r], k + 8, nh);
        UNROLL for (int m = 0; m < MB; ++m) {
          lo[r][m] = _mm256_fmadd_ps(wl, xl[m], lo[r][m]);
          hi[r][m] = _mm256_fmadd_ps(wh, xh[m], hi[r][m]);
        }
      }
    }
    UNROLL for (int r = 0; r < R; ++r)
      UNROLL for (int m = 0; m < MB; ++m) {
        float* t = tot[r][m];
        if (scales) {
          const __m256 sg = _mm256_set1_ps(scales[r][g]);
          _mm256_storeu_ps(t, _mm256_fmadd_ps(lo[r][m], sg, _mm256_loadu_ps(t)));
          _mm256_storeu_ps(t + 8, _mm256_fmadd_ps(hi[r][m], sg, _mm256_loadu_ps(t + 8)));
        } else {
          _mm256_storeu_ps(t, _mm256_add_ps(_mm256_loadu_ps(t), lo[r][m]));
          _mm256_storeu_ps(t + 8, _mm256_add_ps(_mm256_loadu_ps(t + 8), hi[r][m]));
        }
      }
  }
  UNROLL for (int m = 0; m < MB; ++m)
    UNROLL for (int r = 0; r < R; ++r)
      out[m * R + r] = hsum256(_mm256_add_ps(_mm256_loadu_ps(tot[r][m] + 8), _mm256_loadu_ps(tot[r][m])));
}

// out[m * 4 + r] for the block's 4 weight rows and MB <= 2 x rows (dotr_avx2).
template <WT T, int MB>
AVX2 void dot4_avx2(const char* const* w, const float* x, int64_t K, const float* const* scales, int64_t group,
                    int64_t ahead, float* out) {
  if constexpr (MB == 1) {
    dotr_avx2<T, 4, 1>(w, x, K, scales, group, ahead, out);
  } else {
    float half[2 * MB];
    for (int p = 0; p < 2; ++p) {
      dotr_avx2<T, 2, MB>(w + 2 * p, x, K, scales ? scales + 2 * p : nullptr, group, ahead, half);
      for (int m = 0; m < MB; ++m)
        for (int r = 0; r < 2; ++r) out[m * 4 + 2 * p + r] = half[m * 2 + r];
    }
  }
}

// Columns per pass of axpy_avx2 over 4 rows of wt: their pieces (4 KiB of float32) stay in L1
// while the M rows of x use them, so wt is read from memory once whatever M. (Each row of x ran
// over the 4 whole rows, re-reading them from L2 for every row after the first: on a Zen 3 at 5
// rows, 1.5x one row's time.) The chunks change no sum: each output's chain is the same.
constexpr int64_t kAxpyColumns = 256;

template <WT T>
AVX2 void axpy_avx2(const char* wt, int64_t K, int64_t N, const float* x, int64_t M, float* y, int64_t n0,
                    int64_t n1, int64_t k0, int64_t k1) {
  for (int64_t m = 0; m < M; ++m) std::memset(y + m * N + n0, 0, (n1 - n0) * sizeof(float));
  const int64_t row = N * elem_bytes(T);
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    const char *w0 = wt + k * row, *w1 = w0 + row, *w2 = w1 + row, *w3 = w2 + row;
    for (int64_t c0 = n0; c0 < n1; c0 += kAxpyColumns) {  // chunks of a multiple of 8 from n0
      const int64_t c1 = std::min(n1, c0 + kAxpyColumns), full = c0 + (c1 - c0) / 8 * 8;
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = x + m * K + k;
        __m256 x0 = _mm256_set1_ps(xm[0]), x1 = _mm256_set1_ps(xm[1]);
        __m256 x2 = _mm256_set1_ps(xm[2]), x3 = _mm256_set1_ps(xm[3]);
        float* ym = y + m * N;
        int64_t n = c0;
        for (; n < full; n += 8) {
          __m256 acc = _mm256_loadu_ps(ym + n);
          acc = _mm256_fmadd_ps(load8<T>(w0, n), x0, acc);
          acc = _mm256_fmadd_ps(load8<T>(w1, n), x1, acc);
          acc = _mm256_fmadd_ps(load8<T>(w2, n), x2, acc);
          acc = _mm256_fmadd_ps(load8<T>(w3, n), x3, acc);
          _mm256_storeu_ps(ym + n, acc);
        }
        for (; n < c1; ++n)
          ym[n] = std::fma(load1<T>(w3, n), xm[3],
                           std::fma(load1<T>(w2, n), xm[2], std::fma(load1<T>(w1, n), xm[1], std::fma(load1<T>(w0, n), xm[0], ym[n]))));
      }
    }
  }
  for (; k < k1; ++k) {
    const char* w0 = wt + k * row;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = n0; n < n1; ++n) y[m * N + n] = std::fma(load1<T>(w0, n), x[m * K + k], y[m * N + n]);
  }
}

// ---------------------------------------------------------------- ops -----------------

// The transposed weight's inputs in two fixed halves, each summed into its own y and the two
// added at the end: with two threads each task reads whole rows of wt, one contiguous region,
// where a split of the outputs gave each thread half of every row, short strided segments
// (two threads, best of 15 passes: f32 4864 -> 896 339 against 412 us, 896 -> 896 64 against
// 83; one thread unchanged within 1-2%: BENCHMARKS.md, 2026-11-25). The halves are fixed, not
// one per thread, so each output's sum is the same whatever the thread count. Tasks are
// (half, chunk of 64 outputs) pairs, half-major, so two threads take one half each.
template <WT T>
void axpy_kernel(const char* wp, int64_t K, int64_t N, const float* xp, int64_t M, float* yp) {
  const int64_t chunk = 64;
  const int64_t grain = std::max<int64_t>(1, kMinWeightsPerTask * input_parts(K) / (chunk * std::max<int64_t>(K, 1)));
  const bool wide = isa() == kAvx512;
  over_input_halves(M, N, K, chunk, grain, yp, [&](int64_t n0, int64_t n1, int64_t k0, int64_t k1, float* y) {
    if (wide)
      axpy_avx512<T>(wp, K, N, xp, M, y, n0, n1, k0, k1);
    else
      axpy_avx2<T>(wp, K, N, xp, M, y, n0, n1, k0, k1);
  });
}

at::Tensor linear_t_2d(const at::Tensor& x_in, const at::Tensor& wt, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(isa() != kNone, "decodekit GEMV kernels need AVX2 + FMA");
  TORCH_CHECK(wt.dim() == 2 && wt.is_contiguous() && wt.device().is_cpu(), "wt must be a contiguous CPU [K, N] tensor");
  const int64_t K = wt.size(0), N = wt.size(1);
  check_rows(x_in, K);
  at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const char* wp = static_cast<const char*>(wt.data_ptr());
  float *xp = x.data_ptr<float>(), *yp = y.data_ptr<float>();
  switch (wt.scalar_type()) {
    case at::kFloat: axpy_kernel<WT::F32>(wp, K, N, xp, M, yp); break;
    case at::kBFloat16: axpy_kernel<WT::BF16>(wp, K, N, xp, M, yp); break;
    case at::kHalf: axpy_kernel<WT::F16>(wp, K, N, xp, M, yp); break;
    default: TORCH_CHECK(false, "wt must be float32, bfloat16 or float16");
  }
  return finish(y, bias, x_in.scalar_type());
}


template <WT T>
void rows_kernel(const char* wp, int64_t row_bytes, int64_t N, int64_t K, const float* xp, int64_t M,
                 const float* sp, int64_t G, int64_t group, float* yp) {
  const int64_t blocks = (N + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, kMinWeightsPerTask / (4 * std::max<int64_t>(K, 1)));
  const bool wide = isa() == kAvx512;
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * 4, rows = std::min<int64_t>(4, N - n0);
      const char* w[4];
      const float* s[4];
      for (int r = 0; r < 4; ++r) {
        const int64_t n = n0 + std::min<int64_t>(r, rows - 1);
        w[r] = wp + n * row_bytes;
        s[r] = sp ? sp + n * G : nullptr;
      }
      const float* const* sc = sp ? s : nullptr;
      for_row_blocks(M, [&](int64_t m0, int64_t mb) {
        float out[16];
        const float* x = xp + m0 * K;
        const int64_t ahead = m0 == 0 ? kAheadBytes : 0;  // later x blocks hit the cache
        // AVX-512: rows under 4 KiB (int8 896 -> 9,728; 2,048 -> 8,192) prefetch as one stream
        // a block or more ahead, longer ones a stream per row (on a Zen 4, int8 896 -> 4,864
        // ran 452-456 us with streams per row, 194-233 with one; 4,864 -> 896 335-337 against
        // 357-380; weights not in cache, alternated processes: 2,048 -> 1,536 299 -> 184 us,
        // 2,048 -> 8,192 1,602 -> 865, 3,072 -> 3,072 810 -> 692, 3,584 and 4,096 no better).
        const bool short_rows = row_bytes < 4096;
        const int64_t wide_ahead = ahead && short_rows ? std::max(ahead, 4 * row_bytes) : ahead;
        if (!wide)
          for (int64_t m = 0; m < mb; m += 2) {  // pairs of x rows (dot4_avx2)
            const float* xm = xp + (m0 + m) * K;
            // At least a whole block ahead: a row's prefetch lands in the next block, not in
            // rows of this one that the other 4 streams read now (Zen 3, int8 4864 -> 896:
            // 6.2 GB/s with 8 KiB, 8.6 with one block, 19 KiB).
            const int64_t first = m == 0 && ahead ? std::max(ahead, 4 * row_bytes) : 0;
            if (mb - m >= 2)
              dot4_avx2<T, 2>(w, xm, K, sc, group, first, out + 4 * m);
            else
              dot4_avx2<T, 1>(w, xm, K, sc, group, first, out + 4 * m);
          }
        else if (short_rows)
          dot4_avx512_rows<T, true>(mb, w, x, K, sc, group, wide_ahead, out);
        else
          dot4_avx512_rows<T, false>(mb, w, x, K, sc, group, wide_ahead, out);
        for (int64_t m = 0; m < mb; ++m)
          for (int64_t r = 0; r < rows; ++r) yp[(m0 + m) * N + n0 + r] = out[m * 4 + r];
      });
    }
  });
}

// bf16 w [N, K] times bf16 x [M, K] (AVX-512 only: dot_bf16_avx512), y [M, N] in f32.
void bf16_rows_kernel(const uint16_t* wp, int64_t N, int64_t K, const uint16_t* xp, int64_t M, float* yp) {
  const int64_t grain = std::max<int64_t>(1, kMinWeightsPerTask / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint16_t* w = wp + n * K;
      for_row_blocks(M, [&](int64_t m0, int64_t mb) {  // the row is read from memory once
        float out[4];
        const uint16_t* x = xp + m0 * K;
        const int64_t ahead = m0 == 0 ? kAheadBytes : 0;  // later x blocks hit the cache
        if (mb == 4)
          dot_bf16_avx512<4>(w, x, K, ahead, out);
        else if (mb == 3)
          dot_bf16_avx512<3>(w, x, K, ahead, out);
        else if (mb == 2)
          dot_bf16_avx512<2>(w, x, K, ahead, out);
        else
          dot_bf16_avx512<1>(w, x, K, ahead, out);
        for (int64_t m = 0; m < mb; ++m) yp[(m0 + m) * N + n] = out[m];
      });
    }
  });
}

at::Tensor linear_rows_2d(const at::Tensor& x_in, const at::Tensor& w, const c10::optional<at::Tensor>& scales,
                          int64_t group, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(isa() != kNone, "decodekit GEMV kernels need AVX2 + FMA");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(), "w must be a contiguous CPU [N, K] tensor");
  const int64_t N = w.size(0), K = w.size(1);
  check_rows(x_in, K);
  at::Tensor s;
  int64_t G = 1;
  if (scales.has_value() && scales->defined()) {
    s = scales->to(at::kFloat).contiguous();
    TORCH_CHECK(s.dim() == 2 && s.size(0) == N && group > 0 && s.size(1) * group == K,
                "scales must be [N, K / group]");
    G = s.size(1);
  } else {
    group = K;
  }
  TORCH_CHECK(group >= 1, "group must be positive");
  if (w.scalar_type() == at::kBFloat16 && x_in.scalar_type() == at::kBFloat16 && !s.defined() && avx512_bf16()) {
    // bf16 x bf16: products exact in f32 (dot_bf16_avx512); f32 x keeps the f32 kernel below.
    at::Tensor x = x_in.contiguous();
    at::Tensor y = at::empty({x.size(0), N}, x.options().dtype(at::kFloat));
    bf16_rows_kernel(reinterpret_cast<const uint16_t*>(w.data_ptr()), N, K,
                     reinterpret_cast<const uint16_t*>(x.data_ptr()), x.size(0), y.data_ptr<float>());
    return finish(y, bias, at::kBFloat16);
  }
  at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* sp = s.defined() ? s.data_ptr<float>() : nullptr;
  const char* wp = static_cast<const char*>(w.data_ptr());
  const int64_t rb = K * w.element_size();
  float *xp = x.data_ptr<float>(), *yp = y.data_ptr<float>();
  switch (w.scalar_type()) {
    case at::kFloat: rows_kernel<WT::F32>(wp, rb, N, K, xp, M, sp, G, group, yp); break;
    case at::kBFloat16: rows_kernel<WT::BF16>(wp, rb, N, K, xp, M, sp, G, group, yp); break;
    case at::kHalf: rows_kernel<WT::F16>(wp, rb, N, K, xp, M, sp, G, group, yp); break;
    case at::kChar: rows_kernel<WT::I8>(wp, rb, N, K, xp, M, sp, G, group, yp); break;
    default: TORCH_CHECK(false, "w must be float32, bfloat16, float16 or int8");
  }
  return finish(y, bias, x_in.scalar_type());
}

at::Tensor linear_t(const at::Tensor& x, const at::Tensor& wt, const c10::optional<at::Tensor>& bias) {
  return like_rows(linear_t_2d(as_rows(x), wt, bias), x);
}

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scales,
                       int64_t group, const c10::optional<at::Tensor>& bias) {
  return like_rows(linear_rows_2d(as_rows(x), w, scales, group, bias), x);
}

// A float weight w [N, K] in either layout: the transposed one (w.t() contiguous, as
// models/native.py keeps float32) through linear_t, a row-major one through linear_rows,
// any other through a row-major copy.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2, "w must be a [N, K] tensor");
  const at::Tensor rows = as_rows(x);
  const at::Tensor wt = w.t();
  if (wt.is_contiguous()) return like_rows(linear_t_2d(rows, wt, bias), x);
  return like_rows(linear_rows_2d(rows, w.contiguous(), c10::nullopt, 0, bias), x);
}

int64_t isa_op() { return isa(); }

}  // namespace

TORCH_LIBRARY(decodekit, m) {
  m.def("isa() -> int", &isa_op);
  m.def("linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_t(Tensor x, Tensor wt, Tensor? bias) -> Tensor");
  m.def("linear_rows(Tensor x, Tensor w, Tensor? scales, int group, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(decodekit, CPU, m) {
  m.impl("linear", &linear);
  m.impl("linear_t", &linear_t);
  m.impl("linear_rows", &linear_rows);
}
