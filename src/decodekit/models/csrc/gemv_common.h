// Shared by decodekit's kernel sources (gemv.cpp, gemv_a8.cpp): the instruction set chosen
// once per process, the work per parallel task, and the ops' row handling (x [..., K] in,
// [..., N] out, bias added and the dtype restored by `finish`).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

// One target per instruction family a kernel uses (issue 39): the float and int8 kernels need
// AVX-512 F/BW/VL/DQ only, so Skylake-SP, Cascade Lake and Ice Lake run them; the kernels that
// use vdpbf16ps (int4, bf16 x bf16) also need AVX-512 BF16 (`avx512_bf16`), and gemv_a8.cpp's
// vpdpbusd needs VNNI.
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))
#define AVX2 __attribute__((target("avx2,fma,f16c")))
// Small loops over the register blocks unroll fully, so their accumulators stay in registers.
#define UNROLL _Pragma("GCC unroll 16")

namespace {

enum Isa : int64_t { kNone = 0, kAvx2 = 1, kAvx512 = 2 };

// kAvx512: AVX-512 F/BW/VL/DQ (with AVX2 + FMA + F16C). DECODEKIT_GEMV_ISA=avx2 forces the AVX2
// variants (tests compare the two), "none" the pure-torch paths.
int64_t detect_isa() {
  const char* forced = std::getenv("DECODEKIT_GEMV_ISA");
  __builtin_cpu_init();
  bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (forced && std::strcmp(forced, "none") == 0) return kNone;
  if (forced && std::strcmp(forced, "avx2") == 0) return avx2 ? kAvx2 : kNone;
  return avx512 ? kAvx512 : (avx2 ? kAvx2 : kNone);
}

int64_t isa() {
  static const int64_t level = detect_isa();
  return level;
}

// Whether the kernels built on vdpbf16ps (AVX512_BF16) run: the AVX-512 level and BF16.
bool avx512_bf16() {
  static const bool bf16 = [] {
    __builtin_cpu_init();
    return isa() == kAvx512 && __builtin_cpu_supports("avx512bf16");
  }();
  return bf16;
}

// Work per parallel task: small layers run on one thread (a fork costs a few microseconds).
constexpr int64_t kMinWeightsPerTask = 1 << 17;
// How far ahead of each row's reads the dot-product kernels prefetch (prefetch_ahead): 8 KiB
// measured best for bf16, int8 and int4 alike at 896 -> 4864 (one block of 4 rows ahead, the
// first kernels' choice, was up to 20% slower for int8 and int4 once they decoded faster).
constexpr int64_t kAheadBytes = 8192;

// The float32 kernels over the transposed layout (gemv.cpp's axpy, gemm.cpp) sum the inputs
// [0, mid) and [mid, K) apart, each from zero, and add the two: two threads then each read one
// contiguous half of wt (gemv.cpp `axpy_kernel`). One place for `mid`, so both kernels give a
// row the same bits.
inline int64_t input_half(int64_t K) { return K >= 64 ? K / 2 / 4 * 4 : K; }  // K < 64: one part
inline int64_t input_parts(int64_t K) { return input_half(K) < K ? 2 : 1; }

// The axpy GEMV's driver (gemm.cpp keeps its second half's sums per block in registers
// instead): tasks of (half of the inputs, chunk of `width` outputs), half-major, so two
// threads take one half each; run(n0, n1, k0, k1, y) sums inputs [k0, k1) of outputs [n0, n1)
// into y, the output for the first half, a second buffer from zero for the second, which is
// added into the output at the end. `grain`: at least this many tasks a thread.
template <class Run>
void over_input_halves(int64_t M, int64_t N, int64_t K, int64_t width, int64_t grain, float* yp, Run run) {
  const int64_t mid = input_half(K), parts = input_parts(K), chunks = (N + width - 1) / width;
  at::Tensor hi_t = parts == 2 ? at::empty({M, N}, at::kFloat) : at::Tensor();
  float* hi = parts == 2 ? hi_t.data_ptr<float>() : nullptr;
  at::parallel_for(0, parts * chunks, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t part = t0 / chunks; part < parts && part * chunks < t1; ++part) {
      const int64_t c0 = std::max(t0, part * chunks) - part * chunks, c1 = std::min(t1, (part + 1) * chunks) - part * chunks;
      run(c0 * width, std::min(N, c1 * width), part ? mid : 0, part ? K : mid, part ? hi : yp);
    }
  });
  if (hi)
    for (int64_t i = 0; i < M * N; ++i) yp[i] += hi[i];
}

inline float bf16_to_float(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) { return c10::BFloat16(f).x; }  // round to nearest even

AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

void check_rows(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == K, "x must be a CPU [M, ", K, "] tensor");
}

// The ops take x [..., K] and return [..., N]: callers need no reshape (a decode step calls
// them ~100 times, and each Python-side reshape and view costs about a microsecond).
at::Tensor as_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1, "x must have at least one dimension");
  return x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
}

at::Tensor like_rows(const at::Tensor& y, const at::Tensor& x) {
  if (x.dim() == 2) return y;
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = y.size(1);
  return y.view(shape);
}

template <typename Out>
void store_row(const float* y, int64_t N, const float* bias, Out* out) {
  for (int64_t n = 0; n < N; ++n) out[n] = Out(bias ? y[n] + bias[n] : y[n]);
}

// y [M, N] in f32 -> the result in `dtype`, plus bias.
at::Tensor finish(const at::Tensor& y, const c10::optional<at::Tensor>& bias, at::ScalarType dtype) {
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(at::kFloat).contiguous();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const int64_t M = y.size(0), N = y.size(1);
  if (dtype == at::kFloat) {
    if (bp)
      for (int64_t m = 0; m < M; ++m) {
        float* row = y.data_ptr<float>() + m * N;
        for (int64_t n = 0; n < N; ++n) row[n] += bp[n];
      }
    return y;
  }
  at::Tensor out = at::empty({M, N}, y.options().dtype(dtype));
  for (int64_t m = 0; m < M; ++m) {
    const float* row = y.data_ptr<float>() + m * N;
    if (dtype == at::kBFloat16)
      store_row(row, N, bp, out.data_ptr<at::BFloat16>() + m * N);
    else if (dtype == at::kHalf)
      store_row(row, N, bp, out.data_ptr<at::Half>() + m * N);
    else
      TORCH_CHECK(false, "unsupported output dtype");
  }
  return out;
}

// The x rows in blocks of up to 4, each weight block decoded once per x block (dot4_avx512).
template <typename Block>
void for_row_blocks(int64_t M, const Block& block) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) block(m0, std::min<int64_t>(4, M - m0));
}

// The scale rows [G] of the 4 weight rows from n0 (of `rows` real ones: a last, partial block
// repeats its last row, whose outputs are dropped), out of scales [N, G].
inline void block_scale_rows(const float* scales, int64_t n0, int64_t rows, int64_t G, const float* sr[4]) {
  for (int r = 0; r < 4; ++r) sr[r] = scales + (n0 + std::min<int64_t>(r, rows - 1)) * G;
}

}  // namespace
