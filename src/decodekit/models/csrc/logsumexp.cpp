// decodekit::row_logsumexp(x): log(sum(exp(x))) of each row of a float32 [R, V] CPU tensor, as
// float32 [R]: the normaliser of a row's log-softmax, without writing the row. A decode step
// reports the raw log-probability of each sampled token, x[t] - logsumexp(x); at a real
// vocabulary (151,936 logits) torch's log_softmax takes 86-116 us a row for it (it writes the
// whole row), this op 50-60 (sampling/select.py `chosen_logprobs`, BENCHMARKS.md).
//
// Two passes over a row: its maximum m, then the sum of exp(x - m) in float32 with a Cephes-style
// exp (the argument split into n ln 2 + r, a degree-6 polynomial for e^r, 2^n from the exponent
// bits; relative error ~2e-7 against the exact value), in lane sums added in one fixed order,
// then the tail past the last whole vector. A row's result depends on that row alone.
#include "gemv_common.h"

#include <cmath>
#include <limits>

namespace {

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 = hi + lo
constexpr float kExpFloor = -87.3f;  // below, e^x is under float32's smallest normal: taken as e^-87.3
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

// e^x for x <= 0 (x - a row's maximum), 8 lanes.
AVX2 inline __m256 exp_avx2(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpFloor));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 y = _mm256_set1_ps(kP0);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP1));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP2));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP3));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP4));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP5));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// The same for one float (a row's tail), in the same arithmetic.
inline float exp_scalar(float x) {
  x = std::max(x, kExpFloor);
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(-n, kLn2Hi, x);
  r = std::fma(-n, kLn2Lo, r);
  float y = kP0;
  for (const float p : {kP1, kP2, kP3, kP4, kP5}) y = std::fma(y, r, p);
  y = std::fma(y, r * r, r + 1.0f);
  return std::ldexp(y, static_cast<int>(n));
}

AVX2 float row_max_avx2(const float* x, int64_t V) {
  __m256 a = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), b = a;
  int64_t k = 0;
  for (; k + 16 <= V; k += 16) {
    a = _mm256_max_ps(a, _mm256_loadu_ps(x + k));
    b = _mm256_max_ps(b, _mm256_loadu_ps(x + k + 8));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(a, b));
  float m = lanes[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, lanes[i]);
  for (; k < V; ++k) m = std::max(m, x[k]);
  return m;
}

AVX2 float row_logsumexp_avx2(const float* x, int64_t V) {
  const float m = row_max_avx2(x, V);
  if (!std::isfinite(m)) return m;  // all -inf: -inf; a +inf or NaN: itself
  const __m256 mv = _mm256_set1_ps(m);
  __m256 a = _mm256_setzero_ps(), b = a;
  int64_t k = 0;
  for (; k + 16 <= V; k += 16) {
    a = _mm256_add_ps(a, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + k), mv)));
    b = _mm256_add_ps(b, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + k + 8), mv)));
  }
  float total = hsum256(_mm256_add_ps(a, b));
  for (; k < V; ++k) total += exp_scalar(x[k] - m);
  return m + std::log(total);
}

at::Tensor row_logsumexp(const at::Tensor& x_in) {
  TORCH_CHECK(isa() != kNone, "decodekit kernels need AVX2 + FMA");
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
              "x must be a float32 CPU tensor [R, V]");
  const at::Tensor x = x_in.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({R}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = row_logsumexp_avx2(xp + r * V, V);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(decodekit, m) {
  m.def("row_logsumexp(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(decodekit, CPU, m) {
  m.impl("row_logsumexp", &row_logsumexp);
}
