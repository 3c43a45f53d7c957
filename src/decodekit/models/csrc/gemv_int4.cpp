// decodekit's weight-only int4 GEMV (decodekit::linear_int4): y = x W^T (+ bias) for a few rows,
// int4 codes repacked by kernels.pack_int4_blocks, one f32 scale per channel or per group of
// 32j inputs, x rounded to bfloat16 (as qlinear.py's int4pack path), f32 sums.
//
// Layout: blocks of 4 weight rows one after another; inside one, chunks of 128 inputs, each of
// the 4 rows' 64 bytes in turn: 32 little-endian words, word j holding inputs j, 32 + j, 64 + j
// and 96 + j as code + 8 in its nibbles 0..3. Plane i of a chunk (nibble i of its 32 words) is
// its inputs 32i .. 32i + 31; groups are whole planes, and a group's sum is scaled after its
// last plane. Each kernel decodes a weight block once for up to 4 rows of x, and each (row,
// x row) sum runs the same operations in the same order whatever the rows in the call.
//
// AVX-512 BF16 (int4_dot4_avx512): plane i (word >> 4i) -> 32 bf16 weights through one vpermw
// (a 16-entry table), dot products with bf16 x by vdpbf16ps (exact products, f32 sums).
//
// AVX2 + FMA, and AVX-512 without BF16 (int4_dot4_avx2, issue 39): no instruction turns nibbles
// into floats, and on a Zen 3 core every vector op per 8 weights shows (widening each nibble by
// shift, mask, convert and subtract ran at 2 GB/s of int4, 1.1x the float32 kernel). So a nibble
// is masked in place, never shifted down: a 32-byte load holds 16 words, two per 32-bit lane;
// (lanes & 0xF << p) converts (vcvtdq2ps) to (code + 8) 2^p exactly, and x is stored times 2^-p
// in the order the lanes meet it (`prepare_x_avx2`), so one AND, one convert and one FMA per 8
// weights add (code + 8) x. The + 8 comes off per group: each lane's sum starts from -8 times the
// sum of the x values it will meet, so a group sums code * x: the AVX-512 kernel's value up to
// float32 rounding (the two are not bit-equal; no test says they are). x 2^-p (p <= 24) is exact
// for |x| >= 2^-118; smaller inputs round on the subnormal grid (an error below 2^-126 each, as
// vdpbf16ps flushes subnormals to zero on the AVX-512 side). Each plane is decoded once for up to
// 2 x rows (sums per weight row and x row: 4 x 2 chains fit AVX2's 16 registers). The AND,
// convert and FMA per 8 weights bound it on the Zen 3 (~6.6 ns a plane of 4 rows from L1, ~225 us
// for 896 -> 4864); two chains per sum at one x row (low and high words apart, 8 in all) measured
// no faster, and at two x rows (two passes of 2 weight rows) 1.2-1.35x slower (2026-11-28).

#include "gemv_common.h"

#include <cmath>

namespace {

// ---------------------------------------------------------------- AVX-512 BF16 --------

// int4: a block of 4 weight rows, stored as chunks of 128 inputs x 4 rows, 64 bytes per row
// (file comment); x rows in bf16, zero padded to Kp, row stride Kp. The 64 bytes are 32
// words, word j holding inputs j, 32 + j, 64 + j and 96 + j in its nibbles 0..3 (as q + 8):
// plane i (word >> 4i) becomes 32 bf16 weights through one vpermw, whose index is the word's
// low 5 bits, so the table holds the 16 values twice and nothing needs masking. Group sizes
// are multiples of 32 (one plane); a group's sum is scaled after its last plane. Each plane
// is decoded once for all MB x rows, and each (r, m) sum runs the same operations whatever MB.
template <int MB, bool G32>
AVX512_BF16 void int4_dot4_avx512(const uint8_t* wb, const uint16_t* x, int64_t Kp, const float* const* scales,
                             int64_t group, int64_t ahead, float* out) {
  alignas(64) static const uint16_t table[32] = {
      0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
      0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};
  const __m512i lut = _mm512_load_si512(table);
  __m512 tot[4][MB], acc[4][MB];
  UNROLL for (int r = 0; r < 4; ++r)
    UNROLL for (int m = 0; m < MB; ++m) tot[r][m] = acc[r][m] = _mm512_setzero_ps();
  const int64_t planes = Kp / 32, per_group = group / 32;
  for (int64_t b = 0; b < Kp / 128; ++b) {
    const uint8_t* chunk = wb + b * 256;
    if (ahead)
      UNROLL for (int i = 0; i < 4; ++i) _mm_prefetch(reinterpret_cast<const char*>(chunk + ahead + 64 * i), _MM_HINT_T0);
    UNROLL for (int i = 0; i < 4; ++i) {
      const int64_t c = b * 4 + i;
      const __m128i shift = _mm_cvtsi32_si128(4 * i);
      UNROLL for (int r = 0; r < 4; ++r) {
        __m512i v = _mm512_srl_epi16(_mm512_loadu_si512(chunk + 64 * r), shift);
        __m512bh wq = (__m512bh)_mm512_permutexvar_epi16(v, lut);
        if constexpr (G32) {  // each plane its own group: its sum is scaled at once
          const __m512 s = _mm512_set1_ps(scales[r][c]);
          UNROLL for (int m = 0; m < MB; ++m) {
            const __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), wq, (__m512bh)_mm512_loadu_si512(x + m * Kp + c * 32));
            tot[r][m] = _mm512_fmadd_ps(d, s, tot[r][m]);
          }
        } else {
          UNROLL for (int m = 0; m < MB; ++m)
            acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wq, (__m512bh)_mm512_loadu_si512(x + m * Kp + c * 32));
        }
      }
      if (!G32 && ((c + 1) % per_group == 0 || c + 1 == planes)) {
        const int64_t g = c / per_group;
        UNROLL for (int r = 0; r < 4; ++r)
          UNROLL for (int m = 0; m < MB; ++m) {
            tot[r][m] = _mm512_fmadd_ps(acc[r][m], _mm512_set1_ps(scales[r][g]), tot[r][m]);
            acc[r][m] = _mm512_setzero_ps();
          }
      }
    }
  }
  UNROLL for (int m = 0; m < MB; ++m)
    UNROLL for (int r = 0; r < 4; ++r) out[m * 4 + r] = _mm512_reduce_add_ps(tot[r][m]);
}

template <bool G32>
void int4_rows(int64_t mb, const uint8_t* wb, const uint16_t* x, int64_t Kp, const float* const* scales, int64_t group,
               int64_t ahead, float* out) {
  if (mb == 4) int4_dot4_avx512<4, G32>(wb, x, Kp, scales, group, ahead, out);
  else if (mb == 3) int4_dot4_avx512<3, G32>(wb, x, Kp, scales, group, ahead, out);
  else if (mb == 2) int4_dot4_avx512<2, G32>(wb, x, Kp, scales, group, ahead, out);
  else int4_dot4_avx512<1, G32>(wb, x, Kp, scales, group, ahead, out);
}

// ---------------------------------------------------------------- AVX2 ----------------

// The AVX2 kernel's x: per row, Kp floats in the order its lanes meet them, and per group 8
// lane sums. In chunk c, plane i and half h (words 16h .. 16h + 15), the 8 floats at
// 128c + 32i + 16h + 8s are lane l = 0..7's input 128c + 32i + 16h + 2l + s (s = 0: the lane's
// low word, 1: its high word), times the power of 16 its decode leaves out (`int4_lanes`);
// corr[g * 8 + l] = -8 times the sum of group g's inputs in lane l (bf16-rounded, unscaled).
struct Int4X {
  const float* x;     // [M, Kp]
  const float* corr;  // [M, G * 8]
  int64_t G;
};

// What x is multiplied by for plane i (0..3) of a lane's low (s = 0) or high (s = 1) word: 1 /
// what its decode multiplies the codes by (`int4_lanes`), a power of two: 2^-(4i + 16s), except
// the high word's plane 3, decoded by a shift (times 1).
constexpr float kXScale[4][2] = {{1.0f, 0x1p-16f}, {0x1p-4f, 0x1p-20f}, {0x1p-8f, 0x1p-24f}, {0x1p-12f, 1.0f}};

// One pass over x in 16-input halves of a plane (a group is whole planes, so a half never
// straddles two): half `base` holds inputs base + 2l + s at base + 8s + l. (It ran per input
// with divisions and an ldexp call: 130 us at K = 4,864 on the Zen 3, more than the weights.)
void prepare_x_avx2(const float* x, int64_t M, int64_t K, int64_t Kp, int64_t group, float* xs, float* corr) {
  const int64_t G = (Kp + group - 1) / group;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    float* xm = xs + m * Kp;
    for (int64_t base = 0; base < Kp; base += 16) {
      const float* scale = kXScale[(base >> 5) & 3];
      float* cg = corr + (m * G + base / group) * 8;
      for (int64_t l = 0; l < 8; ++l) {
        const int64_t k = base + 2 * l;
        const float lo = k < K ? bf16_to_float(float_to_bf16(xr[k])) : 0.0f;
        const float hi = k + 1 < K ? bf16_to_float(float_to_bf16(xr[k + 1])) : 0.0f;
        xm[base + l] = lo * scale[0];
        xm[base + 8 + l] = hi * scale[1];
        cg[l] += lo;  // in input order: a fixed order
        cg[l] += hi;
      }
    }
    for (int64_t i = 0; i < G * 8; ++i) corr[m * G * 8 + i] *= -8.0f;
  }
}

// Plane I's codes + 8 of a lane's low (S = 0) and high (S = 1) word as floats, from the 32-bit
// lanes v, masked in place: times 16^I (low word), 2^16 16^I (high word, I < 3); the high word's
// plane 3 (bits 28-31, the sign bit) is shifted down instead: times 1 (`kXScale`).
template <int I, int S>
AVX2 inline __m256 int4_lanes(__m256i v) {
  if constexpr (S == 1 && I == 3) return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 28));
  return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF << (4 * I + 16 * S))));
}

// One plane (I) of one chunk, for the 4 weight rows and MB x rows: acc[r][m] += (code + 8) * x,
// halves h = 0, 1 in turn, each low words then high words; x loaded once for the 4 rows.
template <int I, int MB>
AVX2 inline void int4_plane_avx2(const uint8_t* chunk, const float* const* xc, __m256 (&acc)[4][MB]) {
  UNROLL for (int h = 0; h < 2; ++h) {
    __m256 xl[MB], xh[MB];
    UNROLL for (int m = 0; m < MB; ++m) {
      xl[m] = _mm256_loadu_ps(xc[m] + 32 * I + 16 * h);
      xh[m] = _mm256_loadu_ps(xc[m] + 32 * I + 16 * h + 8);
    }
    UNROLL for (int r = 0; r < 4; ++r) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 64 * r + 32 * h));
      const __m256 lo = int4_lanes<I, 0>(v), hi = int4_lanes<I, 1>(v);
      UNROLL for (int m = 0; m < MB; ++m) {
        acc[r][m] = _mm256_fmadd_ps(lo, xl[m], acc[r][m]);
        acc[r][m] = _mm256_fmadd_ps(hi, xh[m], acc[r][m]);
      }
    }
  }
  // Each plane loads the chunk's words again: without this barrier GCC keeps all 8 loads of the
  // 4 planes in registers, spills them, and runs ~15% slower.
  asm volatile("" ::: "memory");
}

// After each plane: when a group ends there (`left` of its planes counted down to 0), acc,
// scaled, is added into tot (in memory: AVX2's 16 registers hold the plane loop's) and restarts
// from the next group's -8 x lane sums.
template <int MB>
AVX2 inline void int4_group_end(int64_t& left, int64_t& g, int64_t per_group, const Int4X& x,
                                const float* const* scales, __m256 (&acc)[4][MB], float (&tot)[4][MB][8]) {
  if (--left) return;
  left = per_group;
  UNROLL for (int r = 0; r < 4; ++r) {
    const __m256 s = _mm256_set1_ps(scales[r][g]);
    UNROLL for (int m = 0; m < MB; ++m) {
      _mm256_storeu_ps(tot[r][m], _mm256_fmadd_ps(acc[r][m], s, _mm256_loadu_ps(tot[r][m])));
      acc[r][m] = _mm256_loadu_ps(x.corr + m * x.G * 8 + (g + 1) * 8);  // past the last group: padding
    }
  }
  ++g;
}

// out[m * 4 + r] for a block of 4 weight rows and MB <= 2 rows of x (Int4X, from row 0); one
// chain per (r, m), the same operations whatever MB. (Measured on the Zen 3, 896 -> 9728 from
// memory: 1.4x one row's weights/s at MB = 2, no more at 3 or 4, whose sums spill.)
template <int MB>
AVX2 void int4_dot4_avx2(const uint8_t* wb, const Int4X& x, int64_t Kp, const float* const* scales, int64_t group,
                         int64_t ahead, float* out) {
  float tot[4][MB][8] = {};
  __m256 acc[4][MB];
  UNROLL for (int r = 0; r < 4; ++r)
    UNROLL for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_loadu_ps(x.corr + m * x.G * 8);
  const int64_t per_group = std::min(group, Kp) / 32;  // the last group may be short (padding)
  int64_t left = per_group, g = 0;
  for (int64_t b = 0; b < Kp / 128; ++b) {
    const uint8_t* chunk = wb + b * 256;
    if (ahead)
      UNROLL for (int i = 0; i < 4; ++i) _mm_prefetch(reinterpret_cast<const char*>(chunk + ahead + 64 * i), _MM_HINT_T0);
    const float* xc[MB];
    UNROLL for (int m = 0; m < MB; ++m) xc[m] = x.x + m * Kp + b * 128;
    int4_plane_avx2<0, MB>(chunk, xc, acc);
    int4_group_end<MB>(left, g, per_group, x, scales, acc, tot);
    int4_plane_avx2<1, MB>(chunk, xc, acc);
    int4_group_end<MB>(left, g, per_group, x, scales, acc, tot);
    int4_plane_avx2<2, MB>(chunk, xc, acc);
    int4_group_end<MB>(left, g, per_group, x, scales, acc, tot);
    int4_plane_avx2<3, MB>(chunk, xc, acc);
    int4_group_end<MB>(left, g, per_group, x, scales, acc, tot);
  }
  if (left != per_group) {  // a last, short group (Kp not a multiple of the group)
    left = 1;
    int4_group_end<MB>(left, g, per_group, x, scales, acc, tot);
  }
  UNROLL for (int m = 0; m < MB; ++m)
    UNROLL for (int r = 0; r < 4; ++r) out[m * 4 + r] = hsum256(_mm256_loadu_ps(tot[r][m]));
}

// ---------------------------------------------------------------- op ------------------

// w: uint8 [ceil(N / 4) * 4, Kp / 2] as kernels.pack_int4_blocks lays it out (blocks of 4 rows,
// chunks of 128 inputs); scales: f32 [N, ceil(Kp / group)].
at::Tensor linear_int4_2d(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& scales_in, int64_t group,
                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(isa() != kNone, "decodekit GEMV kernels need AVX2 + FMA");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu() &&
                  w.size(0) % 4 == 0 && w.size(1) % 64 == 0,
              "w must be a contiguous CPU uint8 [4j, Kp / 2] tensor, Kp a multiple of 128");
  const int64_t Kp = w.size(1) * 2;
  TORCH_CHECK(group > 0 && group % 32 == 0, "group must be a multiple of 32");
  at::Tensor s = scales_in.to(at::kFloat).contiguous();
  const int64_t N = s.size(0);
  TORCH_CHECK(s.dim() == 2 && (N + 3) / 4 * 4 == w.size(0) && s.size(1) == (Kp + group - 1) / group,
              "scales must be [N, ceil(Kp / group)] with w holding ceil(N / 4) * 4 rows");
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2 && x_in.size(1) <= Kp, "x must be a CPU [M, K <= Kp] tensor");
  const int64_t M = x_in.size(0), K = x_in.size(1);
  at::Tensor xf = x_in.to(at::kFloat).contiguous();
  const float* xs = xf.data_ptr<float>();
  const int64_t G = s.size(1);
  // x rounded to bfloat16 and zero padded: bf16 codes for vdpbf16ps, or the AVX2 kernel's floats.
  const bool bf16 = avx512_bf16();
  // (AVX2: x [M, Kp], then corr [M, G * 8] and 8 floats the kernel loads past the last group.)
  at::Tensor xb_t = bf16 ? at::zeros({M, Kp}, at::kShort) : at::zeros({M * (Kp + G * 8) + 8}, at::kFloat);
  uint16_t* xb = bf16 ? reinterpret_cast<uint16_t*>(xb_t.data_ptr<int16_t>()) : nullptr;
  Int4X x2{nullptr, nullptr, G};
  if (bf16) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) xb[m * Kp + k] = float_to_bf16(xs[m * K + k]);
  } else {
    float* xr = xb_t.data_ptr<float>();
    prepare_x_avx2(xs, M, K, Kp, group, xr, xr + M * Kp);
    x2 = Int4X{xr, xr + M * Kp, G};
  }
  at::Tensor y = at::empty({M, N}, xf.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = s.data_ptr<float>();
  const int64_t block_bytes = 2 * Kp;  // 4 rows of Kp / 2 bytes
  const int64_t blocks = (N + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, kMinWeightsPerTask / (4 * Kp));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * 4, rows = std::min<int64_t>(4, N - n0);
      const uint8_t* wb = wp + b * block_bytes;
      const float* sr[4];
      block_scale_rows(sp, n0, rows, G, sr);
      for_row_blocks(M, [&](int64_t m0, int64_t mb) {
        float out[16];
        const int64_t ahead = m0 == 0 ? kAheadBytes : 0;  // later x blocks hit the cache
        if (bf16) {
          const uint16_t* x = xb + m0 * Kp;
          if (group == 32)
            int4_rows<true>(mb, wb, x, Kp, sr, group, ahead, out);
          else
            int4_rows<false>(mb, wb, x, Kp, sr, group, ahead, out);
        } else {
          for (int64_t m = 0; m < mb; m += 2) {  // pairs of x rows: 16 accumulators fit AVX2's registers
            const Int4X xm{x2.x + (m0 + m) * Kp, x2.corr + (m0 + m) * G * 8, G};
            if (mb - m >= 2)
              int4_dot4_avx2<2>(wb, xm, Kp, sr, group, m == 0 ? ahead : 0, out + 4 * m);
            else
              int4_dot4_avx2<1>(wb, xm, Kp, sr, group, m == 0 ? ahead : 0, out + 4 * m);
          }
        }
        for (int64_t m = 0; m < mb; ++m)
          for (int64_t r = 0; r < rows; ++r) yp[(m0 + m) * N + n0 + r] = out[m * 4 + r];
      });
    }
  });
  return finish(y, bias, x_in.scalar_type());
}

at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, int64_t group,
                       const c10::optional<at::Tensor>& bias) {
  return like_rows(linear_int4_2d(as_rows(x), w, scales, group, bias), x);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(decodekit, m) {
  m.def("linear_int4(Tensor x, Tensor w, Tensor scales, int group, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(decodekit, CPU, m) { m.impl("linear_int4", &linear_int4); }
