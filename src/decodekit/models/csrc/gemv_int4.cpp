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
// AVX2 + FMA, and AVX-512 without BF16 (int4_dot4_avx2, issue 39): x, rounded to bfloat16 as
// above, is held as int16 per plane of 32 inputs times a power of two (`Int4X`), and a plane's
// codes multiply it by `_mm256_madd_epi16` (16 products a step, summed in pairs, exactly in
// int32): per 16 weights a shift and a mask, one madd, one add; per plane and weight row one
// convert and one FMA by the plane's scale. Each plane's sum is exact where its inputs lie
// within 2^7 of its largest (smaller ones are rounded to 2^-15 of it: on heavy-tailed inputs an
// output moves by up to 3e-5 of the largest, where the bfloat16 rounding of x moves it by 1e-3),
// so the AVX2 and AVX-512 kernels agree to that, not bit for bit (no test says they do). The
// float kernel before it (nibbles masked in place, converted, one FMA per 8 weights) ran
// 1.2-1.26x slower at one x row on a Zen 4 with the AVX2 variants forced, 1.18x at 5 rows
// (2026-11-28). Each plane is decoded once for up to 2 x rows (4 x 2 float chains). Per channel
// (the op's group >= Kp: one scale per weight row, a single group) the kernel is built without
// the group-end count after each plane (int4_dot4_avx2<MB, true>), the group scaled once after
// the plane loop: the same bits, 5.5-6.4% faster at one x row (896 -> 4,864 126.5 -> 118.4 us,
// 4,864 -> 896 114.8 -> 108.5 us, medians of 5 alternating rounds, one thread, Zen 4 forced to
// AVX2, 2026-11-28/29); grouped calls run the same machine code as before.

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

// The AVX2 kernel's x, per row: each plane of 32 inputs (a group is whole planes) rounded to
// bfloat16, then as int16 codes times a power of two, `scale` = 2^(E - 15) for the plane's
// largest |x| < 2^E: every input within 2^7 of that largest is exact (its 8 significant bits
// land on the integer grid) and a smaller one is rounded to it (an error below 2^-15 of the
// largest). Codes + 8 times these integers sum exactly in int32 (at most 32 x 15 x 32640 <
// 2^24), so a plane's sum converts to float exactly and times the scale exactly: each plane's
// dot product is exact, where the float kernel rounded after every product. The weight codes
// are q + 8: a group sums (q + 8) x exactly per plane, and `corr` per group, 8 times the sum of
// its x (each plane's integers summed exactly, times its scale, in plane order), comes off once
// at the end, per weight row times its scale. A plane holding a NaN or an infinity gets a NaN
// scale (its sums are NaN); a plane whose largest |x| is below 2^-111 is zeros.
struct Int4X {
  const int16_t* x;    // [M, Kp]
  const float* scale;  // [M, Kp / 32]
  const float* corr;   // [M, G]
  int64_t G;
};

// One plane: 32 floats (zero padded past K) -> codes and scale (the struct's comment); returns
// the sum of the codes (exact).
AVX2 inline int32_t prepare_plane_avx2(const float* v, int16_t* q, float* scale) {
  const __m256i round = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
  const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i exponent = _mm256_set1_epi32(0x7F800000);
  __m256 b[4], top = _mm256_setzero_ps();
  __m256i special = _mm256_setzero_si256();  // lanes holding a NaN or an infinity
  UNROLL for (int i = 0; i < 4; ++i) {  // round to nearest even bfloat16 (c10::BFloat16's, finite x)
    const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(v + 8 * i));
    special = _mm256_or_si256(special, _mm256_cmpeq_epi32(_mm256_and_si256(u, exponent), exponent));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    b[i] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(round, odd)), high));
    top = _mm256_max_ps(top, _mm256_and_ps(b[i], magnitude));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float largest = 0.0f;
  for (int l = 0; l < 8; ++l) largest = std::max(largest, lanes[l]);
  const bool finite = _mm256_testz_si256(special, special) && std::isfinite(largest);  // rounding may overflow
  int e = 0;
  std::frexp(largest, &e);  // largest < 2^e
  if (!finite || largest < 0x1p-111f) {
    std::memset(q, 0, 32 * sizeof(int16_t));
    *scale = finite ? 0.0f : std::nanf("");
    return 0;
  }
  *scale = std::ldexp(1.0f, e - 15);
  const __m256 up = _mm256_set1_ps(std::ldexp(1.0f, 15 - e));
  __m256i w[4];
  UNROLL for (int i = 0; i < 4; ++i) w[i] = _mm256_cvtps_epi32(_mm256_mul_ps(b[i], up));  // nearest even
  // packs interleaves 128-bit halves: [0-3, 8-11, 4-7, 12-15] -> permute back to 0..15
  const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(w[0], w[1]), 0xD8);
  const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(w[2], w[3]), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), hi);
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) int32_t sums[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(sums),
                     _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones)));
  return sums[0] + sums[1] + sums[2] + sums[3] + sums[4] + sums[5] + sums[6] + sums[7];
}

void prepare_x_avx2(const float* x, int64_t M, int64_t K, int64_t Kp, int64_t group, int16_t* xq, float* scale,
                    float* corr) {
  const int64_t planes = Kp / 32, per_group = std::min(group, Kp) / 32, G = (planes + per_group - 1) / per_group;
  float tail[32];
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    for (int64_t g = 0; g < G; ++g) corr[m * G + g] = 0.0f;
    for (int64_t p = 0; p < planes; ++p) {
      const float* v = xr + 32 * p;
      if (32 * p + 32 > K) {  // the last, partial plane (or padding): zeros past K
        for (int64_t j = 0; j < 32; ++j) tail[j] = 32 * p + j < K ? xr[32 * p + j] : 0.0f;
        v = tail;
      }
      float* sp = scale + m * planes + p;
      const int32_t sum = prepare_plane_avx2(v, xq + m * Kp + 32 * p, sp);
      corr[m * G + p / per_group] += 8.0f * float(sum) * *sp;  // 8 x the plane's sum: exact
    }
  }
}

// Plane I's codes + 8 of the 16 words of v, as int16 lanes.
template <int I>
AVX2 inline __m256i int4_codes(__m256i v) {
  if constexpr (I == 0) return _mm256_and_si256(v, _mm256_set1_epi16(0xF));
  else if constexpr (I == 3) return _mm256_srli_epi16(v, 12);
  else return _mm256_and_si256(_mm256_srli_epi16(v, 4 * I), _mm256_set1_epi16(0xF));
}

// One plane (I) of one chunk, for the 4 weight rows and MB x rows: the plane's exact int32 sums
// of codes (+ 8) times x, converted and scaled into acc[r][m]. Each plane is decoded
// once for the MB x rows; each (r, m) runs the same operations whatever MB.
template <int I, int MB>
AVX2 inline void int4_plane_avx2(const uint8_t* chunk, const Int4X& x, int64_t Kp, int64_t c, __m256 (&acc)[4][MB]) {
  const int64_t planes = Kp / 32;
  __m256i x0[MB], x1[MB];
  UNROLL for (int m = 0; m < MB; ++m) {
    const int16_t* xp = x.x + m * Kp + 32 * c;
    x0[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp));
    x1[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 16));
  }
  UNROLL for (int r = 0; r < 4; ++r) {
    const __m256i w0 = int4_codes<I>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 64 * r)));
    const __m256i w1 = int4_codes<I>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 64 * r + 32)));
    UNROLL for (int m = 0; m < MB; ++m) {
      const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(w0, x0[m]), _mm256_madd_epi16(w1, x1[m]));
      acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_broadcast_ss(x.scale + m * planes + c), acc[r][m]);
    }
  }
}

// After each plane: when a group ends there (`left` of its planes counted down to 0), acc times
// the group's scale is added into tot (in memory: the registers hold the plane loop's) and
// restarts from zero.
template <int MB>
AVX2 inline void int4_group_end(int64_t& left, int64_t& g, int64_t per_group, const Int4X& x,
                                const float* const* scales, __m256 (&acc)[4][MB], float (&tot)[4][MB][8],
                                float (&off)[4][MB]) {
  if (--left) return;
  left = per_group;
  UNROLL for (int r = 0; r < 4; ++r) {
    const __m256 s = _mm256_set1_ps(scales[r][g]);
    UNROLL for (int m = 0; m < MB; ++m) {
      _mm256_storeu_ps(tot[r][m], _mm256_fmadd_ps(acc[r][m], s, _mm256_loadu_ps(tot[r][m])));
      off[r][m] = std::fma(scales[r][g], x.corr[m * x.G + g], off[r][m]);
      acc[r][m] = _mm256_setzero_ps();
    }
  }
  ++g;
}

// out[m * 4 + r] for a block of 4 weight rows and MB <= 2 rows of x (Int4X, from row 0); one
// chain per (r, m), the same operations whatever MB. PerChannel (one scale per weight row: the
// op's group >= Kp, a single group): no group end to count after each plane, the one group's
// scaling done once after the loop by the same int4_group_end, so the same operations in the
// same order as the grouped path runs on a single group (the same bits).
template <int MB, bool PerChannel>
AVX2 void int4_dot4_avx2(const uint8_t* wb, const Int4X& x, int64_t Kp, const float* const* scales, int64_t group,
                         int64_t ahead, float* out) {
  float tot[4][MB][8] = {}, off[4][MB] = {};
  __m256 acc[4][MB];
  UNROLL for (int r = 0; r < 4; ++r)
    UNROLL for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
  const int64_t per_group = std::min(group, Kp) / 32;  // the last group may be short (padding)
  int64_t left = per_group, g = 0;
  for (int64_t b = 0; b < Kp / 128; ++b) {
    const uint8_t* chunk = wb + b * 256;
    if (ahead)
      UNROLL for (int i = 0; i < 4; ++i) _mm_prefetch(reinterpret_cast<const char*>(chunk + ahead + 64 * i), _MM_HINT_T0);
    int4_plane_avx2<0, MB>(chunk, x, Kp, 4 * b, acc);
    if constexpr (!PerChannel) int4_group_end<MB>(left, g, per_group, x, scales, acc, tot, off);
    int4_plane_avx2<1, MB>(chunk, x, Kp, 4 * b + 1, acc);
    if constexpr (!PerChannel) int4_group_end<MB>(left, g, per_group, x, scales, acc, tot, off);
    int4_plane_avx2<2, MB>(chunk, x, Kp, 4 * b + 2, acc);
    if constexpr (!PerChannel) int4_group_end<MB>(left, g, per_group, x, scales, acc, tot, off);
    int4_plane_avx2<3, MB>(chunk, x, Kp, 4 * b + 3, acc);
    if constexpr (!PerChannel) int4_group_end<MB>(left, g, per_group, x, scales, acc, tot, off);
  }
  if (PerChannel || left != per_group) {  // the one group, or a last, short one (Kp not a multiple of it)
    left = 1;
    int4_group_end<MB>(left, g, per_group, x, scales, acc, tot, off);
  }
  UNROLL for (int m = 0; m < MB; ++m)
    UNROLL for (int r = 0; r < 4; ++r) out[m * 4 + r] = hsum256(_mm256_loadu_ps(tot[r][m])) - off[r][m];
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
  // x rounded to bfloat16 and zero padded: bf16 codes for vdpbf16ps, or the AVX2 kernel's int16
  // planes (Int4X).
  const bool bf16 = avx512_bf16();
  at::Tensor xb_t;
  uint16_t* xb = nullptr;
  Int4X x2{nullptr, nullptr, nullptr, G};
  if (bf16) {
    xb_t = at::zeros({M, Kp}, at::kShort);
    xb = reinterpret_cast<uint16_t*>(xb_t.data_ptr<int16_t>());
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) xb[m * Kp + k] = float_to_bf16(xs[m * K + k]);
  } else {  // one buffer: scales [M, Kp / 32], corr [M, G], then the int16 codes [M, Kp]
    const int64_t floats = M * (Kp / 32) + M * G;
    xb_t = at::empty({floats + (M * Kp + 1) / 2}, at::kFloat);
    float* buf = xb_t.data_ptr<float>();
    x2 = Int4X{reinterpret_cast<int16_t*>(buf + floats), buf, buf + M * (Kp / 32), G};
    prepare_x_avx2(xs, M, K, Kp, group, const_cast<int16_t*>(x2.x), buf, buf + M * (Kp / 32));
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
            const Int4X xm{x2.x + (m0 + m) * Kp, x2.scale + (m0 + m) * (Kp / 32), x2.corr + (m0 + m) * G, G};
            const int64_t pf = m == 0 ? ahead : 0;
            if (group >= Kp)  // per channel: one group, scaled after the plane loop
              (mb - m >= 2 ? int4_dot4_avx2<2, true> : int4_dot4_avx2<1, true>)(wb, xm, Kp, sr, group, pf, out + 4 * m);
            else
              (mb - m >= 2 ? int4_dot4_avx2<2, false> : int4_dot4_avx2<1, false>)(wb, xm, Kp, sr, group, pf, out + 4 * m);
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
