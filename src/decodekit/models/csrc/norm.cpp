// decodekit::rms_norm(x, weight, eps): x / sqrt(mean(x^2) + eps) * weight over the last dim, in
// float32: models/native.py's RMSNorm on the eager CPU path, as one op.
//
// At batch 1 a decode step is bound by per-op overhead as much as by its matmuls: F.rms_norm and
// the weight's multiply cost ~44 us a call on the Zen 3 (ATen runs pow, mean, add, rsqrt and two
// multiplies), this op ~10 (BENCHMARKS.md, "Eager decode overhead"); a layer calls it twice.
// Each row is computed alone in one fixed order (8 lane sums of squares added by hsum256, then
// the inputs past the last multiple of 8), so a row's result does not depend on the other rows
// of the call.
#include "gemv_common.h"

#include <cmath>

namespace {

// sum of squares of x[0, K): 8 lanes over the multiple of 8, summed by hsum256, then the rest.
AVX2 float sum_squares_avx2(const float* x, int64_t K) {
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float total = hsum256(acc);
  for (; k < K; ++k) total += x[k] * x[k];
  return total;
}

AVX2 void scale_row_avx2(const float* x, const float* w, float r, int64_t K, float* y) {
  const __m256 rv = _mm256_set1_ps(r);
  int64_t k = 0;
  for (; k + 8 <= K; k += 8)
    _mm256_storeu_ps(y + k, _mm256_mul_ps(_mm256_loadu_ps(w + k), _mm256_mul_ps(_mm256_loadu_ps(x + k), rv)));
  for (; k < K; ++k) y[k] = w[k] * (x[k] * r);
}

void check_float_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  TORCH_CHECK(isa() != kNone, "decodekit kernels need AVX2 + FMA");
  check_float_cpu(x_in, "x");
  check_float_cpu(weight_in, "weight");
  const at::Tensor x = as_rows(x_in).contiguous();
  const at::Tensor weight = weight_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == K, "weight must be [", K, "]");
  at::Tensor y = at::empty({M, K}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kMinWeightsPerTask / std::max<int64_t>(K, 1));
  at::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float mean = sum_squares_avx2(xp + m * K, K) / float(K);
      const float r = 1.0f / std::sqrt(mean + float(eps));
      scale_row_avx2(xp + m * K, wp, r, K, yp + m * K);
    }
  });
  return like_rows(y, x_in);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(decodekit, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(decodekit, CPU, m) {
  m.impl("rms_norm", &rms_norm);
}
