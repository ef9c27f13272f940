// float32 linear layers on CPUs with AVX-512: out[M, N] = x[M, K] @ W^T (+ bias), W packed once
// into panels of 64 output columns, each panel [K, 64] contiguous (pack: kernels/linear.py).
//
// Why by hand: oneDNN's inner product ran a decode step's products (32 rows) at ~330 GFLOP/s on
// the Zen 5 EPYC, two-thirds of what the FMA units give; this loop runs them at 380-450 and
// larger row counts at ~490-510, oneDNN's best or better (docs/benchmarks.md). The weights are
// read once per step from DRAM, a panel at a time, and the panel (K x 256 bytes, well inside L2)
// is reused from L2 for every block of 6 rows: 24 accumulators (6 rows x 4 vectors of 16
// columns), 4 panel loads and 6 broadcasts per k, the next panel prefetched meanwhile.
//
// Each output is one chain of fused multiply-adds in k order, whatever M, the thread count or
// the other rows: results do not depend on the batch. Like any kernel's but MKL's, they differ
// from MKL's sgemm in the last bits (~1e-6 relative).
//
// Built against torch's stable C++ API, registered as torch.ops.shoal.panel_linear. The loop is
// compiled for AVX-512 alone (a target attribute): callers use it only where the CPU has it.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <cstdint>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SHOAL_HAS_AVX512_LINEAR 1
#endif

namespace {

constexpr int64_t kPanel = 64;      // output columns per panel: 4 vectors of 16
constexpr int64_t kRows = 6;        // rows per register block: 6 x 4 accumulators
constexpr int64_t kPrefetchK = 32;  // panel rows (k) prefetched ahead by the first block

#ifdef SHOAL_HAS_AVX512_LINEAR
#define SHOAL_AVX512 __attribute__((target("avx512f,fma")))

// R rows of x times one panel: `cols` (<= 64) columns of out, starting from bias or zero.
// `ahead`: prefetch this panel kPrefetchK rows ahead (its first block, which streams it from
// DRAM); `next`, `next_per_k`: lines of the next panel to bring into L2, that many per k.
template <int R>
SHOAL_AVX512 inline __attribute__((always_inline)) void block(const float* x, int64_t K, const float* panel,
                                                             const float* bias, float* out, int64_t ldo,
                                                             int64_t cols, bool ahead, const char* next,
                                                             int64_t next_per_k) {
  __m512 acc[R][4];
  for (int j = 0; j < 4; ++j) {
    const __mmask16 keep = static_cast<__mmask16>(cols >= 16 * (j + 1) ? 0xFFFF : cols > 16 * j ? (1u << (cols - 16 * j)) - 1 : 0);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + 16 * j) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) acc[r][j] = b;
  }
  for (int64_t k = 0; k < K; ++k) {
    const float* p = panel + k * kPanel;
    if (ahead)
      for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchK * kPanel + 16 * j), _MM_HINT_T0);
    if (next)
      for (int64_t i = 0; i < next_per_k; ++i) _mm_prefetch(next + (k * next_per_k + i) * 64, _MM_HINT_T1);
    const __m512 w0 = _mm512_loadu_ps(p), w1 = _mm512_loadu_ps(p + 16);
    const __m512 w2 = _mm512_loadu_ps(p + 32), w3 = _mm512_loadu_ps(p + 48);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(a, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(a, w3, acc[r][3]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    const __mmask16 keep = static_cast<__mmask16>(cols >= 16 * (j + 1) ? 0xFFFF : cols > 16 * j ? (1u << (cols - 16 * j)) - 1 : 0);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ldo + 16 * j, keep, acc[r][j]);
  }
}

// Every row of x times one panel (the panel stays in L2 from the first block on). The blocks
// after the first, which compute from L2, bring the next panel (`next`, null for a thread's
// last) into L2 meanwhile, so that its first block does not wait on DRAM: at 32 rows that took
// the products from 1.1-1.4x to 1.3-1.45x oneDNN's speed.
SHOAL_AVX512 void panel_rows(const float* x, int64_t M, int64_t K, const float* panel, const float* next,
                             const float* bias, float* out, int64_t N, int64_t cols) {
  const int64_t blocks = (M + kRows - 1) / kRows;
  const int64_t lines = K * kPanel * int64_t(sizeof(float)) / 64;  // cache lines of a panel
  const int64_t per_k = blocks > 1 ? (lines / K + blocks - 2) / (blocks - 1) : 0;
  auto next_of = [&](int64_t b) -> const char* {  // block b's share of the next panel
    const int64_t first = (b - 1) * K * per_k;
    return next != nullptr && b > 0 && first < lines ? reinterpret_cast<const char*>(next) + first * 64 : nullptr;
  };
  int64_t m = 0, b = 0;
  for (; m + kRows <= M; m += kRows, ++b)
    block<kRows>(x + m * K, K, panel, bias, out + m * N, N, cols, b == 0, next_of(b), per_k);
  const float* xm = x + m * K;
  float* om = out + m * N;
  const char* nx = next_of(b);
  switch (M - m) {
    case 1: block<1>(xm, K, panel, bias, om, N, cols, b == 0, nx, per_k); break;
    case 2: block<2>(xm, K, panel, bias, om, N, cols, b == 0, nx, per_k); break;
    case 3: block<3>(xm, K, panel, bias, om, N, cols, b == 0, nx, per_k); break;
    case 4: block<4>(xm, K, panel, bias, om, N, cols, b == 0, nx, per_k); break;
    case 5: block<5>(xm, K, panel, bias, om, N, cols, b == 0, nx, per_k); break;
    default: break;
  }
}
#endif

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

void panel_linear(Tensor out, Tensor x, Tensor packed, Tensor bias) {
  STD_TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && packed.dim() == 3, "x [M, K], out [M, N], packed [P, K, 64]");
  for (const Tensor* t : {&out, &x, &packed})
    STD_TORCH_CHECK(t->is_cpu() && t->scalar_type() == ScalarType::Float && t->is_contiguous(),
                    "out, x and packed must be contiguous float32 CPU tensors");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), panels = packed.size(0);
  STD_TORCH_CHECK(out.size(0) == M && packed.size(1) == K && packed.size(2) == kPanel &&
                      panels == (N + kPanel - 1) / kPanel,
                  "shapes of out, x and packed do not agree");
  const bool has_bias = bias.numel() > 0;
  STD_TORCH_CHECK(!has_bias || (bias.is_cpu() && bias.scalar_type() == ScalarType::Float &&
                                bias.is_contiguous() && bias.numel() == N),
                  "bias must be empty or a contiguous float32 [N]");
#ifdef SHOAL_HAS_AVX512_LINEAR
  STD_TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma"), "panel_linear needs AVX-512");
  if (M == 0) return;
  const float* xp = x.const_data_ptr<float>();
  const float* wp = packed.const_data_ptr<float>();
  const float* bp = has_bias ? bias.const_data_ptr<float>() : nullptr;
  float* op = out.mutable_data_ptr<float>();
  torch::stable::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      panel_rows(xp, M, K, wp + p * K * kPanel, p + 1 < end ? wp + (p + 1) * K * kPanel : nullptr,
                 bp ? bp + p * kPanel : nullptr, op + p * kPanel, N, std::min<int64_t>(kPanel, N - p * kPanel));
  });
#else
  STD_TORCH_CHECK(false, "panel_linear needs an x86-64 build");
#endif
}

}  // namespace

STABLE_TORCH_LIBRARY(shoal_linear, m) {
  m.def("panel_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor bias) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(shoal_linear, CPU, m) {
  m.impl("panel_linear", TORCH_BOX(&panel_linear));
}
