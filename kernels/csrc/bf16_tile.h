// The register tile of the bfloat16 dot-product kernels: bf16_linear.cpp (bf16 weights) and
// int8_linear.cpp (8-bit weights widened to bf16, bf16 activations). Weights come in k-pair
// panels of 16 columns: per pair of k's, each column's two weights side by side, a panel's pairs
// one after another, so one 64-byte load is a panel's 16 columns x 2 k's.
//
// A tile is R rows x C panels: R x C float32 accumulators, C weight loads and R broadcasts (a
// row's pair of k's as one 32-bit lane) per R x C vdpbf16ps. 6 x 4 keeps 24 of the 32 vector
// registers accumulating; on the 2-core Zen 4 it ran at ~90% of vdpbf16ps's rate from 32 rows
// on, where one panel of 8 rows (the 8-bit kernel's first tile) ran at ~75%. Each output is one
// chain over the k pairs in order, whatever M or the other rows.
//
// Functions here are compiled for AVX512-BF16 (a target attribute, forced inline into their
// callers): callers run them only where the CPU has it.
#pragma once

#include <cstdint>
#include <cstring>
#include <immintrin.h>

namespace shoal {

constexpr int64_t kPairCols = 16;   // output columns per panel: one vector of float32 sums
constexpr int kTileRows = 6;        // rows per register tile
constexpr int kTilePanels = 4;      // panels per register tile: 6 x 4 accumulators

#define SHOAL_BF16_TILE inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512bf16")))

// A row's pair (k, k + 1) of bf16 activations as one 32-bit lane (the second zero past K).
inline __attribute__((always_inline)) int32_t x_pair(const uint16_t* x, int64_t k, int64_t K) {
  if (k + 1 < K) {
    int32_t two;
    std::memcpy(&two, x + k, sizeof two);
    return two;
  }
  return x[k];
}

// Rows row0.. row0 + R of x [M, K] times C panels (`stride` elements apart); then
// finish(row, c, sums) for each of the R x C vectors of 16 float32 sums.
template <int R, int C, typename Finish>
SHOAL_BF16_TILE void pairs_tile(const uint16_t* x, int64_t row0, int64_t K, const uint16_t* w, int64_t stride,
                                Finish& finish) {
  x += row0 * K;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) wv[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + c * stride + k * kPairCols));
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(x_pair(x + r * K, k, K)));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, wv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) finish(row0 + r, c, acc[r][c]);
}

// Every row of x [M, K] times C panels: tiles of kTileRows rows, then one of the rows left.
template <int C, typename Finish>
SHOAL_BF16_TILE void pairs_rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t stride,
                                Finish& finish) {
  int64_t m = 0;
  for (; m + kTileRows <= M; m += kTileRows) pairs_tile<kTileRows, C>(x, m, K, w, stride, finish);
  switch (M - m) {
    case 1: pairs_tile<1, C>(x, m, K, w, stride, finish); break;
    case 2: pairs_tile<2, C>(x, m, K, w, stride, finish); break;
    case 3: pairs_tile<3, C>(x, m, K, w, stride, finish); break;
    case 4: pairs_tile<4, C>(x, m, K, w, stride, finish); break;
    case 5: pairs_tile<5, C>(x, m, K, w, stride, finish); break;
    default: break;
  }
}

}  // namespace shoal
