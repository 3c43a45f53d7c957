// decodekit's float32 GEMM for 2 to 8,192 rows (batched decode, prefill):
// decodekit::linear_gemm, y = x W^T (+ bias) over the transposed weight layout models/native.py
// keeps for float32, wt = W^T [K, N] contiguous.
//
// PyTorch's float32 GEMM (MKL / oneDNN) ran at 90-100 GFLOP/s from 64 to 8,192 rows on this
// Zen 5 core and at 50-70 at 8-16 rows, where this kernel ran at 200-240 and 110-175
// (BENCHMARKS.md, "Small-M float32 GEMM"). A register tile of MR rows x NV
// vectors of columns (AVX-512: 16 floats a vector) holds its sums in registers while k runs;
// each step loads the NV weight vectors of row k of wt once and broadcasts x[m, k] into an
// FMA for each of the MR rows. The weight panel of a column tile (KC rows of wt x 16 NV
// columns) stays in L1 / L2 while the row tiles run over it: on AVX2 copied into a contiguous
// buffer from a few row tiles on (kPackTiles), else read in place, the first row tile, which
// reads it from memory, prefetching a few rows of wt ahead.
//
// Each output is summed in the order of decodekit::linear_t's axpy kernels (gemv.cpp): two
// running float32 sums per output, y = fma(wt[k, n], x[m, k], y) for k = 0, 1, ..., mid - 1
// and for k = mid, ..., K - 1, each starting from zero, then added (`input_half`,
// gemv_common.h; the sums are parked in y between panels of KC steps, which loses nothing).
// So a row's result has the same bits whatever the number of rows in the call and whichever
// kernel (this one or linear_t, AVX-512 or AVX2) runs it, and the bias is added afterwards as
// linear_t adds it (`finish`).
#include "gemv_common.h"

#include <cstring>

namespace {

// Steps of k per panel (KC): 64 KiB of wt at the 6 x 4 tile, re-read from L1 / L2 by each row
// tile (128 and 512 measured no better).
constexpr int64_t kPanelSteps = 256;
// Rows of x per block (a multiple of both tiles' rows): a block's slice of x for one panel
// (at most 264 x 256 floats, 264 KiB) stays in L2 while the block runs over the column tiles,
// for prefills of thousands of rows. Each block reads all of wt again, so a prefill of 200-264
// rows runs as one block (192 rows a block left 200 as 192 + 8, the second reading wt for 8
// rows; AVX-512, 200 rows: 72-96 -> 84-105 GFLOP/s at Llama-3.1-8B's widths, 81-99 -> 89-104
// at the 240M shape's).
constexpr int64_t kBlockRows = 264;
// AVX2: from this many row tiles in a block, each panel of a column tile is first copied into
// a contiguous buffer (`packed`, 24 KiB) that the row tiles then read; in place, the panel's
// 256 rows are a row of wt apart, each on its own page, and where that stride is a multiple of
// 4 KiB (N a multiple of 1,024: Llama-3.1-8B's 4,096-28,672) all in the same few L1 sets, so
// every row tile re-read them from L2 or memory. The copy prefetches the next panel's lines
// into L2. Medians of 3 alternated runs, Zen 4 (no AMX), one thread, AVX2 kernels forced,
// GFLOP/s before -> after (BENCHMARKS.md, "Huge pages and a packed GEMM panel"): at
// Llama-3.1-8B's widths 16 rows 29-30 -> 33-35, 64 rows 49-53 -> 59-64, 200 rows 46-58 ->
// 77-83; at the 240M shape's (strides not a multiple of 4 KiB) 64 rows 56-60 -> 62-67, 200 rows
// 54-64 -> 74-83, and 16 rows, left in place, within noise. AVX-512's tile reads 4 lines of a
// row a step and measured no better packed (16 rows: 0.57-1.12x), so it reads in place.
constexpr int64_t kPackTiles = 3;          // N a multiple of 1,024 floats (rows 4 KiB-aligned apart)
constexpr int64_t kPackTilesAnyStride = 16;  // otherwise
// Work per parallel task, in multiply-adds (see linear_gemm_2d).
constexpr int64_t kMinFmasPerTask = 1 << 20;
// How many rows of wt ahead of the step being computed the first row tile prefetches (past
// the end of wt too: a prefetch never faults). 8 measured better than 0, 16 or 24.
constexpr int64_t kPrefetchRows = 8;

// ---------------------------------------------------------------- AVX-512 -------------

// Where a tile's sums come from and go: they start from `in` (row stride in_stride) or, when
// it is null, from zero; `add` (row stride add_stride), when not null, is added to them at the
// end (the first half's sums: y = first + second, `input_half`); they are stored to `out`.
struct Sums {
  const float* in;
  int64_t in_stride;
  float* out;
  int64_t out_stride;
  const float* add;
  int64_t add_stride;
};

// The sums of rows x[0:MR] (row stride K) times wt's columns [0, 16 NV) (row stride N; the
// last vector masked by `tail`) over the steps [k0, k1), kept as `sums` says.
template <int MR, int NV>
AVX512 void tile_avx512(const float* x, int64_t K, const float* w, int64_t N, int64_t k0, int64_t k1, const Sums& sums,
                        __mmask16 tail, bool prefetch) {
  __m512 acc[MR][NV];
  UNROLL for (int m = 0; m < MR; ++m)
    UNROLL for (int v = 0; v < NV; ++v) {
      const __mmask16 mask = v == NV - 1 ? tail : __mmask16(0xFFFF);
      acc[m][v] = sums.in ? _mm512_maskz_loadu_ps(mask, sums.in + m * sums.in_stride + 16 * v) : _mm512_setzero_ps();
    }
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + k * N;
    if (prefetch)
      UNROLL for (int v = 0; v < NV; ++v) _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchRows * N + 16 * v), _MM_HINT_T0);
    __m512 b[NV];
    UNROLL for (int v = 0; v < NV - 1; ++v) b[v] = _mm512_loadu_ps(wk + 16 * v);
    b[NV - 1] = _mm512_maskz_loadu_ps(tail, wk + 16 * (NV - 1));
    UNROLL for (int m = 0; m < MR; ++m) {
      const __m512 a = _mm512_set1_ps(x[m * K + k]);
      UNROLL for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_fmadd_ps(b[v], a, acc[m][v]);
    }
  }
  UNROLL for (int m = 0; m < MR; ++m)
    UNROLL for (int v = 0; v < NV; ++v) {
      const __mmask16 mask = v == NV - 1 ? tail : __mmask16(0xFFFF);
      if (sums.add) acc[m][v] = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, sums.add + m * sums.add_stride + 16 * v), acc[m][v]);
      _mm512_mask_storeu_ps(sums.out + m * sums.out_stride + 16 * v, mask, acc[m][v]);
    }
}

// ---------------------------------------------------------------- AVX2 ----------------

// The same tile in 8-float vectors; the last vector's columns past the end are masked
// (vmaskmov; `last` of its 8 are real), so it computes exactly what the AVX-512 tile does.
template <int MR, int NV>
AVX2 void tile_avx2(const float* x, int64_t K, const float* w, int64_t N, int64_t k0, int64_t k1, const Sums& sums,
                    int64_t last, bool prefetch) {
  const __m256i all = _mm256_set1_epi32(-1);
  const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(last)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256 acc[MR][NV];
  UNROLL for (int m = 0; m < MR; ++m)
    UNROLL for (int v = 0; v < NV; ++v)
      acc[m][v] = sums.in ? _mm256_maskload_ps(sums.in + m * sums.in_stride + 8 * v, v == NV - 1 ? tail : all)
                          : _mm256_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + k * N;
    if (prefetch)
      UNROLL for (int v = 0; v < NV; v += 2) _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchRows * N + 8 * v), _MM_HINT_T0);
    __m256 b[NV];
    UNROLL for (int v = 0; v < NV - 1; ++v) b[v] = _mm256_loadu_ps(wk + 8 * v);
    b[NV - 1] = _mm256_maskload_ps(wk + 8 * (NV - 1), tail);
    UNROLL for (int m = 0; m < MR; ++m) {
      const __m256 a = _mm256_set1_ps(x[m * K + k]);
      UNROLL for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_fmadd_ps(b[v], a, acc[m][v]);
    }
  }
  UNROLL for (int m = 0; m < MR; ++m)
    UNROLL for (int v = 0; v < NV; ++v) {
      const __m256i mask = v == NV - 1 ? tail : all;
      if (sums.add) acc[m][v] = _mm256_add_ps(_mm256_maskload_ps(sums.add + m * sums.add_stride + 8 * v, mask), acc[m][v]);
      _mm256_maskstore_ps(sums.out + m * sums.out_stride + 8 * v, mask, acc[m][v]);
    }
}

// ---------------------------------------------------------------- driver --------------

// Tile sizes: AVX-512 6 rows x 4 vectors (64 columns, 256 bytes of each row of wt): 24 sums
// in registers (of 32), each step's 4 weight loads serving 24 FMAs. Measured against 8 x 2,
// 4 x 4, 5 x 4, 7 x 4, 8 x 3, 12 x 2 and 4 x 6 on both models' shapes (benchmarks/gemm_rows.py,
// BENCHMARKS.md): 6 x 4 best or within the noise of the best at 16-64 rows; the 2-vector tiles
// lost up to 30 % at 240M (each step reading 128 bytes of a row of wt from memory). AVX2 (16
// registers): 4 rows x 3 vectors.
template <bool Wide>
struct Tile;
template <>
struct Tile<true> {
  static constexpr int kRows = 6, kVectors = 4, kWidth = 16;
};
template <>
struct Tile<false> {
  static constexpr int kRows = 4, kVectors = 3, kWidth = 8;
};

// Calls tile<MR, NV> for the run-time rows mr <= R and vectors nv <= V (the compiler
// instantiates every pair once).
template <bool Wide, int R, int V>
void run_tile(int mr, int nv, const float* x, int64_t K, const float* w, int64_t N, int64_t k0, int64_t k1,
              const Sums& sums, int64_t last, bool prefetch) {
  if constexpr (R > 1)
    if (mr < R) return run_tile<Wide, R - 1, V>(mr, nv, x, K, w, N, k0, k1, sums, last, prefetch);
  if constexpr (V > 1)
    if (nv < V) return run_tile<Wide, R, V - 1>(mr, nv, x, K, w, N, k0, k1, sums, last, prefetch);
  if constexpr (Wide) {  // `last`: the columns of the tile's last vector, 1..16
    tile_avx512<R, V>(x, K, w, N, k0, k1, sums, __mmask16((1u << last) - 1), prefetch);
  } else {  // `last`: 1..8
    tile_avx2<R, V>(x, K, w, N, k0, k1, sums, last, prefetch);
  }
}

// y[:, n0:n1] for all M rows: blocks of kBlockRows rows, in each the column tiles of the range,
// in each the two halves of the inputs (`input_half`), in each the panels of kPanelSteps steps,
// in each the row tiles. The first half's sums go to y; the second half's run in `scratch`
// (the block's rows x the tile's columns, in L1 / L2) and are added to y at its last panel, so
// no [M, N] buffer is written and read again. The tiles do not change the order of any
// output's sum (file comment), only which sums share a step's loads.
template <bool Wide>
void gemm_columns(const float* x, int64_t M, int64_t K, const float* wt, int64_t N, float* y, int64_t n0, int64_t n1) {
  using T = Tile<Wide>;
  constexpr int64_t cols = T::kVectors * T::kWidth;
  const int64_t mid = input_half(K), halves = input_parts(K);
  std::vector<float> scratch(halves == 2 ? kBlockRows * cols : 0);
  std::vector<float> packed;
  for (int64_t b0 = 0; b0 < M; b0 += kBlockRows) {
    // The block's rows in tiles of nearly equal rows (16 rows: 6, 5, 5 rather than 6, 6, 4): a
    // short tile spends more loads per FMA. Measured 2-8 % faster at 8-64 rows.
    const int64_t rows = std::min(M - b0, kBlockRows), count = (rows + T::kRows - 1) / T::kRows;
    const bool pack = !Wide && count >= (N * int64_t(sizeof(float)) % 4096 == 0 ? kPackTiles : kPackTilesAnyStride);
    if (pack) packed.resize(kPanelSteps * cols);
    for (int64_t c0 = n0; c0 < n1; c0 += cols) {
      const int64_t width = std::min(cols, n1 - c0);
      const int nv = int((width + T::kWidth - 1) / T::kWidth);
      const int64_t last = width - (nv - 1) * T::kWidth;
      for (int64_t half = 0; half < halves; ++half) {
        const int64_t kb = half ? mid : 0, ke = half ? K : mid;
        for (int64_t k0 = kb; k0 < ke; k0 += kPanelSteps) {
          const int64_t k1 = std::min(ke, k0 + kPanelSteps);
          if (pack)
            for (int64_t k = k0; k < k1; ++k) {
              const float* row = wt + k * N + c0;
              for (int64_t o = 0; o < width; o += 16)  // the next panel's line (past wt's end too: no fault)
                _mm_prefetch(reinterpret_cast<const char*>(row + kPanelSteps * N + o), _MM_HINT_T1);
              std::memcpy(packed.data() + (k - k0) * cols, row, width * sizeof(float));
            }
          for (int64_t i = 0, m0 = b0; i < count; ++i) {
            const int mr = int(rows / count + (i < rows % count ? 1 : 0));
            float* yt = y + m0 * N + c0;
            float* st = scratch.data() + (m0 - b0) * cols;
            Sums sums{k0 == kb ? nullptr : yt, N, yt, N, nullptr, 0};
            if (half) sums = k1 == ke ? Sums{k0 == kb ? nullptr : st, cols, yt, N, yt, N}
                                      : Sums{k0 == kb ? nullptr : st, cols, st, cols, nullptr, 0};
            if (pack)  // the panel's step k0 + j is row j of `packed` (row stride `cols`)
              run_tile<Wide, T::kRows, T::kVectors>(mr, nv, x + m0 * K + k0, K, packed.data(), cols, 0, k1 - k0, sums,
                                                   last, false);
            else
              run_tile<Wide, T::kRows, T::kVectors>(mr, nv, x + m0 * K, K, wt + c0, N, k0, k1, sums, last, m0 == b0);
            m0 += mr;
          }
        }
      }
    }
  }
}

at::Tensor linear_gemm_2d(const at::Tensor& x_in, const at::Tensor& wt, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(isa() != kNone, "decodekit GEMM kernel needs AVX2 + FMA");
  TORCH_CHECK(wt.dim() == 2 && wt.is_contiguous() && wt.device().is_cpu() && wt.scalar_type() == at::kFloat,
              "wt must be a contiguous CPU float32 [K, N] tensor");
  const int64_t K = wt.size(0), N = wt.size(1);
  check_rows(x_in, K);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = K ? at::empty({M, N}, x.options()) : at::zeros({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = wt.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool wide = isa() == kAvx512;
  const int64_t cols = wide ? Tile<true>::kVectors * Tile<true>::kWidth : Tile<false>::kVectors * Tile<false>::kWidth;
  const int64_t tiles = (N + cols - 1) / cols;
  // Threads split the column tiles (each output is summed by one thread, in one order). A task
  // gets at least kMinFmasPerTask multiply-adds, ~8-20 us at this kernel's 100-250 GFLOP/s (the
  // GEMV kernels' kMinWeightsPerTask, counted in weights, is ~25 us at their speed), so a
  // fork's few microseconds stay small. (Not tuned: two-thread timings on this shared 2-core
  // machine were noise.) Not `over_input_halves` (gemv_common.h): linear_t splits the input
  // halves between threads so that each reads whole rows of wt, but the GEMM reads wt in
  // 256-byte pieces of rows (a column tile's) anyway, and its second half's sums are added in
  // registers (gemm_columns) instead of through an [M, N] buffer and a pass over it.
  const int64_t grain = std::max<int64_t>(1, kMinFmasPerTask / (cols * std::max<int64_t>(K * M, 1)));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * cols, n1 = std::min(N, t1 * cols);
    if (wide)
      gemm_columns<true>(xp, M, K, wp, N, yp, n0, n1);
    else
      gemm_columns<false>(xp, M, K, wp, N, yp, n0, n1);
  });
  return finish(y, bias, x_in.scalar_type());
}

// x [..., K], a float32 weight w [N, K] in the transposed layout (w.t() contiguous, as
// models/native.py keeps float32; any other layout is copied into it) -> [..., N].
at::Tensor linear_gemm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2, "w must be a [N, K] tensor");
  return like_rows(linear_gemm_2d(as_rows(x), w.t().contiguous(), bias), x);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(decodekit, m) {
  m.def("linear_gemm(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(decodekit, CPU, m) {
  m.impl("linear_gemm", &linear_gemm);
}
