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
// The register tile (6 rows x 4 panels) is bf16_tile.h's. Products of two bf16 are exact in
// float32; each output is one chain over the k pairs in order, whatever M, the thread count or
// the other rows, so results do not depend on the batch. The sum (plus the bias) is rounded to bf16 to
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
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SHOAL_HAS_BF16_LINEAR 1
#endif

#ifdef SHOAL_HAS_BF16_LINEAR
#include "bf16_tile.h"
#endif

namespace {

#ifdef SHOAL_HAS_BF16_LINEAR
using shoal::kPairCols;
using shoal::kTilePanels;

// float32 -> bf16 bits, to nearest even, NaN quiet: c10::BFloat16's rounding, 16 at a time.
SHOAL_BF16_TILE __m256i round_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

// Every row of x times C panels (`stride` elements apart) into `cols` (<= 16 C) columns of out.
template <int C>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void rows_of(
    const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t stride, const uint16_t* bias, uint16_t* out,
    int64_t N, int64_t cols) {
  __m512 b[C];
  __mmask16 keep[C];
  for (int c = 0; c < C; ++c) {
    const int64_t left = cols - c * kPairCols;
    keep[c] = static_cast<__mmask16>(left >= kPairCols ? 0xFFFF : left > 0 ? (1u << left) - 1 : 0);
    b[c] = bias == nullptr ? _mm512_setzero_ps() : _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep[c], bias + c * kPairCols)), 16));
  }
  auto finish = [&](int64_t row, int c, __m512 sums) __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512bf16"))) {
    _mm256_mask_storeu_epi16(out + row * N + c * kPairCols, keep[c], round_bf16(_mm512_add_ps(sums, b[c])));
  };
  shoal::pairs_rows<C>(x, M, K, w, stride, finish);
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
  STD_TORCH_CHECK(out.size(0) == M && packed.size(1) == (K + 1) / 2 && packed.size(2) == 2 * kPairCols &&
                      panels == (N + kPairCols - 1) / kPairCols,
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
  const int64_t stride = packed.size(1) * 2 * kPairCols;  // elements from one panel to the next
  const int64_t groups = (panels + kTilePanels - 1) / kTilePanels;
  torch::stable::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p = g * kTilePanels;
      if (p + kTilePanels <= panels) {
        rows_of<kTilePanels>(xp, M, K, wp + p * stride, stride, bp ? bp + p * kPairCols : nullptr, op + p * kPairCols,
                             N, std::min<int64_t>(kTilePanels * kPairCols, N - p * kPairCols));
        continue;
      }
      for (int64_t q = p; q < panels; ++q)  // the last panels, fewer than a tile's
        rows_of<1>(xp, M, K, wp + q * stride, stride, bp ? bp + q * kPairCols : nullptr, op + q * kPairCols, N,
                   std::min<int64_t>(kPairCols, N - q * kPairCols));
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
