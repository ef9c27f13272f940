// bfloat16 linear layers on CPUs with AVX512-BF16 and no AMX (Zen 4 and later, Cooper Lake):
// out[M, N] = x[M, K] @ W^T (+ bias), x, W, bias and out bfloat16, W packed once in k-pair
// panels of 16 columns, [ceil(N / 16), ceil(K / 2), 16 x 2]: per pair of k's, each column's
// weights of k and k + 1 side by side (pack: kernels/packed_weights.py `pairs`).
//
// Why by hand: at a decode step's few rows oneDNN's bf16 inner product read its weights from
// DRAM at 16-22 GB/s on the 2-core Zen 4 EPYC, where this loop reads them at 26-36 (the
// machine's ~30): a Qwen2.5-0.5B layer's projections ran 1.3-1.5x faster at 1-8 rows, 1.1x at
// 32, level from 64 rows on, where both reach ~90% of vdpbf16ps's rate (docs/benchmarks.md).
// And oneDNN's layout is opaque, so a head tied to the embedding was kept twice, once for the
// lookups; a panel's rows are plain to read (kernels/packed_weights.py `pair_rows`).
//
// A tile is 6 rows x 4 panels (64 columns): 24 accumulators, 4 weight loads and 6 broadcasts
// (each a row's pair of k's) per 24 vdpbf16ps. Products of two bf16 are exact in float32; each
// output is one chain over the k pairs in order, whatever M, the thread count or the other
// rows, so results do not depend on the batch. The sum (plus the bias) is rounded to bf16 to
// nearest even as torch rounds (denormals kept: vcvtneps2bf16 would flush them).
//
// Built against torch's stable C++ API, registered as torch.ops.shoal_bf16.bf16_linear; the
// loop is compiled for AVX512-BF16 alone (a target attribute): callers use it only where the
// CPU has it (kernels/native.py).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SHOAL_HAS_BF16_LINEAR 1
#endif

namespace {

constexpr int64_t kCols = 16;       // output columns per panel: one vector of float32 sums
constexpr int kTileRows = 6;        // rows per register tile
constexpr int kTilePanels = 4;      // panels per register tile: 6 x 4 accumulators

#ifdef SHOAL_HAS_BF16_LINEAR
#define SHOAL_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define SHOAL_INLINE inline __attribute__((always_inline))

// A row's pair (k, k + 1) of bf16 activations as one 32-bit lane (the second zero past K).
SHOAL_INLINE int32_t x_pair(const uint16_t* x, int64_t k, int64_t K) {
  if (k + 1 < K) {
    int32_t two;
    std::memcpy(&two, x + k, sizeof two);
    return two;
  }
  return x[k];
}

// float32 -> bf16 bits, to nearest even, NaN quiet: c10::BFloat16's rounding, 16 at a time.
SHOAL_BF16 SHOAL_INLINE __m256i round_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

// R rows times C adjacent panels (`stride` elements apart); `cols` (<= 16 C) columns of out.
template <int R, int C>
SHOAL_BF16 SHOAL_INLINE void tile(const uint16_t* x, int64_t K, const uint16_t* w, int64_t stride,
                                  const uint16_t* bias, uint16_t* out, int64_t ldo, int64_t cols) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) wv[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + c * stride + k * kCols));
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(x_pair(x + r * K, k, K)));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, wv[c]);
    }
  }
  for (int c = 0; c < C && c * kCols < cols; ++c) {
    const int64_t left = cols - c * kCols;
    const __mmask16 keep = static_cast<__mmask16>(left >= kCols ? 0xFFFF : (1u << left) - 1);
    __m512 b = _mm512_setzero_ps();
    if (bias != nullptr)
      b = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias + c * kCols)), 16));
    for (int r = 0; r < R; ++r)
      _mm256_mask_storeu_epi16(out + r * ldo + c * kCols, keep, round_bf16(_mm512_add_ps(acc[r][c], b)));
  }
}

// Every row of x times C panels: tiles of kTileRows rows, then one of the rows left.
template <int C>
SHOAL_BF16 void rows_of(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t stride,
                        const uint16_t* bias, uint16_t* out, int64_t N, int64_t cols) {
  int64_t m = 0;
  for (; m + kTileRows <= M; m += kTileRows)
    tile<kTileRows, C>(x + m * K, K, w, stride, bias, out + m * N, N, cols);
  const uint16_t* xm = x + m * K;
  uint16_t* om = out + m * N;
  switch (M - m) {
    case 1: tile<1, C>(xm, K, w, stride, bias, om, N, cols); break;
    case 2: tile<2, C>(xm, K, w, stride, bias, om, N, cols); break;
    case 3: tile<3, C>(xm, K, w, stride, bias, om, N, cols); break;
    case 4: tile<4, C>(xm, K, w, stride, bias, om, N, cols); break;
    case 5: tile<5, C>(xm, K, w, stride, bias, om, N, cols); break;
    default: break;
  }
}
#endif

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

void bf16_linear(Tensor out, Tensor x, Tensor packed, Tensor bias) {
  STD_TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && packed.dim() == 3, "x [M, K], out [M, N], packed [P, K / 2, 32]");
  for (const Tensor* t : {&out, &x, &packed})
    STD_TORCH_CHECK(t->is_cpu() && t->scalar_type() == ScalarType::BFloat16 && t->is_contiguous(),
                    "out, x and packed must be contiguous bfloat16 CPU tensors");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), panels = packed.size(0);
  STD_TORCH_CHECK(out.size(0) == M && packed.size(1) == (K + 1) / 2 && packed.size(2) == 2 * kCols &&
                      panels == (N + kCols - 1) / kCols,
                  "shapes of out, x and packed do not agree");
  const bool has_bias = bias.numel() > 0;
  STD_TORCH_CHECK(!has_bias || (bias.is_cpu() && bias.scalar_type() == ScalarType::BFloat16 &&
                                bias.is_contiguous() && bias.numel() == N),
                  "bias must be empty or a contiguous bfloat16 [N]");
#ifdef SHOAL_HAS_BF16_LINEAR
  STD_TORCH_CHECK(__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl"),
                  "bf16_linear needs AVX512-BF16");
  if (M == 0) return;
  const auto* xp = static_cast<const uint16_t*>(x.const_data_ptr());
  const auto* wp = static_cast<const uint16_t*>(packed.const_data_ptr());
  const auto* bp = has_bias ? static_cast<const uint16_t*>(bias.const_data_ptr()) : nullptr;
  auto* op = static_cast<uint16_t*>(out.mutable_data_ptr());
  const int64_t stride = packed.size(1) * 2 * kCols;  // elements from one panel to the next
  const int64_t groups = (panels + kTilePanels - 1) / kTilePanels;
  torch::stable::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p = g * kTilePanels;
      if (p + kTilePanels <= panels) {
        rows_of<kTilePanels>(xp, M, K, wp + p * stride, stride, bp ? bp + p * kCols : nullptr, op + p * kCols, N,
                             std::min<int64_t>(kTilePanels * kCols, N - p * kCols));
        continue;
      }
      for (int64_t q = p; q < panels; ++q)  // the last panels, fewer than a tile's
        rows_of<1>(xp, M, K, wp + q * stride, stride, bp ? bp + q * kCols : nullptr, op + q * kCols, N,
                   std::min<int64_t>(kCols, N - q * kCols));
    }
  });
#else
  STD_TORCH_CHECK(false, "bf16_linear needs an x86-64 build");
#endif
}

}  // namespace

STABLE_TORCH_LIBRARY(shoal_bf16, m) {
  m.def("bf16_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor bias) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(shoal_bf16, CPU, m) {
  m.impl("bf16_linear", TORCH_BOX(&bf16_linear));
}
