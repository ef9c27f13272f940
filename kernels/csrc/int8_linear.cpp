// Weight-only int8 linear layers on CPU (--quantization int8): out[M, N] = (x[M, K] @ Q^T) * scale
// (+ bias), Q int8 with one float32 scale per output column, packed once into panels of 16
// columns, each panel [K, 16] contiguous (pack: kernels/quantization.py).
//
// Why by hand: a decode step is bound by reading the weights, and int8 weights are a quarter of
// float32's bytes. torch's own weight-only op (_weight_int8pack_mm) runs float32 activations
// through a scalar loop (10x slower than float32 oneDNN on the 2-core Zen 3), and oneDNN's int8
// products quantize the activations too. Here the panel's 16 int8 weights of one k are widened
// to float32 in registers (2 AVX2 vectors) and reused for a block of 6 rows: 12 accumulators,
// 2 conversions and 6 broadcasts per k; with more rows the panel is widened once and every
// block reads floats. The scale multiplies each finished sum once.
//
// Each output is one chain of fused multiply-adds in k order, whatever M, the thread count or
// the other rows: results do not depend on the batch. Against float32 on the dequantised
// weights (Q * scale) they differ by rounding alone (~1e-6 relative).
//
// AVX2 + FMA (a target attribute, checked at run time), else a portable loop.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <cstdint>
#include <vector>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SHOAL_HAS_AVX2_INT8 1
#endif

namespace {

constexpr int64_t kCols = 16;  // output columns per panel: 2 vectors of 8
constexpr int64_t kRows = 6;   // rows per register block: 6 x 2 accumulators

// The finished sums of `rows` rows of one panel: times the scale, plus the bias, into the
// panel's `cols` (<= 16) columns of out.
inline void finish(const float* sums, int rows, const float* scale, const float* bias, float* out, int64_t ldo,
                   int64_t cols) {
  for (int r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out[r * ldo + c] = sums[r * kCols + c] * scale[c] + (bias ? bias[c] : 0.0f);
}

#ifdef SHOAL_HAS_AVX2_INT8
#define SHOAL_AVX2 __attribute__((target("avx2,fma")))

// R rows times one panel. Int8: the panel's weights are widened per k (decode: few rows, so
// the weights' bytes from DRAM are what counts); float: a panel widened once beforehand.
template <int R, typename W>
SHOAL_AVX2 inline __attribute__((always_inline)) void block(const float* x, int64_t K, const W* panel,
                                                           const float* scale, const float* bias, float* out,
                                                           int64_t ldo, int64_t cols) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 w0, w1;
    if constexpr (sizeof(W) == 1) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + k * kCols));
      w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
      w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
    } else {
      w0 = _mm256_loadu_ps(panel + k * kCols);
      w1 = _mm256_loadu_ps(panel + k * kCols + 8);
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_set1_ps(x[r * K + k]);
      acc[r][0] = _mm256_fmadd_ps(a, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, w1, acc[r][1]);
    }
  }
  alignas(32) float sums[R * kCols];
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(sums + r * kCols, acc[r][0]);
    _mm256_store_ps(sums + r * kCols + 8, acc[r][1]);
  }
  finish(sums, R, scale, bias, out, ldo, cols);
}

template <typename W>
SHOAL_AVX2 void rows_of(const float* x, int64_t M, int64_t K, const W* panel, const float* scale,
                        const float* bias, float* out, int64_t N, int64_t cols) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) block<kRows>(x + m * K, K, panel, scale, bias, out + m * N, N, cols);
  const float* xm = x + m * K;
  float* om = out + m * N;
  switch (M - m) {
    case 1: block<1>(xm, K, panel, scale, bias, om, N, cols); break;
    case 2: block<2>(xm, K, panel, scale, bias, om, N, cols); break;
    case 3: block<3>(xm, K, panel, scale, bias, om, N, cols); break;
    case 4: block<4>(xm, K, panel, scale, bias, om, N, cols); break;
    case 5: block<5>(xm, K, panel, scale, bias, om, N, cols); break;
    default: break;
  }
}

// One row block: widen as it goes. More: widen the panel once into this thread's buffer
// (K x 64 bytes, inside L2) and run every block on floats, so the widening is paid once per
// panel instead of once per block (at 32 rows that was a third of the time).
SHOAL_AVX2 void panel_rows(const float* x, int64_t M, int64_t K, const int8_t* panel, const float* scale,
                           const float* bias, float* out, int64_t N, int64_t cols) {
  if (M <= kRows) return rows_of(x, M, K, panel, scale, bias, out, N, cols);
  thread_local std::vector<float> wide;
  wide.resize(K * kCols);
  float* w = wide.data();
  for (int64_t k = 0; k < K; ++k) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + k * kCols));
    _mm256_storeu_ps(w + k * kCols, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    _mm256_storeu_ps(w + k * kCols + 8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))));
  }
  rows_of(x, M, K, static_cast<const float*>(w), scale, bias, out, N, cols);
}
#endif

void panel_rows_portable(const float* x, int64_t M, int64_t K, const int8_t* panel, const float* scale,
                         const float* bias, float* out, int64_t N, int64_t cols) {
  float sums[kCols];
  for (int64_t m = 0; m < M; ++m) {
    std::fill(sums, sums + kCols, 0.0f);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < kCols; ++c) sums[c] += x[m * K + k] * static_cast<float>(panel[k * kCols + c]);
    finish(sums, 1, scale, bias, out + m * N, N, cols);
  }
}

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

void int8_linear(Tensor out, Tensor x, Tensor packed, Tensor scale, Tensor bias, bool portable) {
  STD_TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && packed.dim() == 3 && scale.dim() == 1,
                  "x [M, K], out [M, N], packed [P, K, 16], scale [N]");
  for (const Tensor* t : {&out, &x, &scale})
    STD_TORCH_CHECK(t->is_cpu() && t->scalar_type() == ScalarType::Float && t->is_contiguous(),
                    "out, x and scale must be contiguous float32 CPU tensors");
  STD_TORCH_CHECK(packed.is_cpu() && packed.scalar_type() == ScalarType::Char && packed.is_contiguous(),
                  "packed must be a contiguous int8 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), panels = packed.size(0);
  STD_TORCH_CHECK(out.size(0) == M && packed.size(1) == K && packed.size(2) == kCols &&
                      panels == (N + kCols - 1) / kCols && scale.numel() == N,
                  "shapes of out, x, packed and scale do not agree");
  const bool has_bias = bias.numel() > 0;
  STD_TORCH_CHECK(!has_bias || (bias.is_cpu() && bias.scalar_type() == ScalarType::Float &&
                                bias.is_contiguous() && bias.numel() == N),
                  "bias must be empty or a contiguous float32 [N]");
  if (M == 0) return;
  const float* xp = x.const_data_ptr<float>();
  const int8_t* wp = packed.const_data_ptr<int8_t>();
  const float* sp = scale.const_data_ptr<float>();
  const float* bp = has_bias ? bias.const_data_ptr<float>() : nullptr;
  float* op = out.mutable_data_ptr<float>();
  auto rows = panel_rows_portable;
#ifdef SHOAL_HAS_AVX2_INT8
  if (!portable && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) rows = panel_rows;
#endif
  torch::stable::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      rows(xp, M, K, wp + p * K * kCols, sp + p * kCols, bp ? bp + p * kCols : nullptr, op + p * kCols, N,
           std::min<int64_t>(kCols, N - p * kCols));
  });
}

}  // namespace

STABLE_TORCH_LIBRARY(shoal_int8, m) {
  m.def("int8_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor scale, Tensor bias, bool portable) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(shoal_int8, CPU, m) {
  m.impl("int8_linear", TORCH_BOX(&int8_linear));
}
