// Weight-only 8-bit linear layers on CPU (--quantization int8 / fp8): out[M, N] = (x[M, K] @ Q^T)
// * scale (+ bias), Q int8 or float8 e4m3 with one float32 scale per output column, packed once
// into panels of 16 columns, each panel [K, 16] contiguous (pack: kernels/quantization.py).
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
// e4m3 widens through float16: its sign, then its exponent and mantissa shifted into a float16's
// (4 of the 5 exponent bits, 3 of the 10 mantissa bits) read as the value / 256, subnormals
// included; the 256 joins the scale. So an fp8 weight costs one more shift-and-or per 16 and
// F16C's conversion, and the sums are the same chains as int8's.
//
// AVX2 + FMA (+ F16C for fp8) (a target attribute, checked at run time), else a portable loop.
//
// bfloat16 activations (a bf16 model on a CPU with AVX512-BF16: Zen 4 and later, Cooper Lake,
// Sapphire Rapids): vdpbf16ps multiplies 32 bf16 pairs into 16 float32 sums per instruction,
// twice float32 FMA's rate, the rate oneDNN's bf16 linears run at; widened to float32 the
// activations made an int8 model 1.5-2x slower than bf16 above a few rows. The weights of k and
// k + 1 are widened to float32 (exact), rounded to bf16 (exact: 8-bit codes, and e4m3's 3
// mantissa bits) and interleaved per column; the activations' pair (k, k + 1) is one 32-bit
// broadcast. Up to 8 rows, a panel's pairs are widened as they are read; with more, 4 panels
// at a time are widened once and every row goes through bf16_tile.h's register tile (6 rows x 4
// panels: at 32 rows 1.1-1.2x faster than one panel of 8 rows). Products are exact in float32,
// so against the float32 path the sums differ by rounding alone; each output is one chain over k
// pairs whatever M or the other rows.
//
// w8a8_sums (--quantization w8a8_int8 on CPUs without AMX, kernels/quantization.py): the exact
// int32 sums of int8 activations times int8 weights, packed in panels of 16 columns
// by groups of 4 k's ([P, K / 4, 16, 4]: a group's 64 bytes are two vectors, each 8 columns x
// 4 k's). vpmaddubsw multiplies unsigned by signed bytes and adds pairs into int16, which
// saturates for u8 x s8 (255 x 127 x 2 > 32767); llama.cpp's trick keeps it exact: |w| as the
// unsigned side (<= 128: an int8 checkpoint's codes may hold -128) and w's sign moved onto x
// (vpsignb; activations are quantized within +-127), so a pair sums to at most 2 x 128 x 127 =
// 32512. vpmaddwd by ones then adds the pairs into int32: 32 products in 4 instructions per
// vector, against float32's 8 per fused multiply-add. Blocks of 4 rows x 16 columns (8
// accumulators) reuse each loaded group and its |w|. The sums are exact integers, so any
// order, thread count or batch gives the same result. With AVX512-VNNI (Cascade Lake, Ice Lake,
// Zen 4 and later) vpdpbusd does a group's 64 products in one instruction, exactly (below), in
// tiles of 8 rows x 2 panels.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SHOAL_HAS_AVX2_INT8 1
#include "bf16_tile.h"
#endif

namespace {

constexpr int64_t kCols = 16;  // output columns per panel: 2 vectors of 8
constexpr int64_t kRows = 6;   // rows per register block: 6 x 2 accumulators
constexpr float kFp8Unit = 256.0f;  // an e4m3 weight widened through float16 is its value / 256

struct Fp8 {  // one float8 e4m3 (fn: no infinities; 0x7f / 0xff are NaN)
  uint8_t bits;
};

// The float16 reading of e4m3 `bits` (its value / 256), for the portable loop.
float fp8_over_unit(uint8_t bits) {
  const int exponent = (bits >> 3) & 15, mantissa = bits & 7;
  float v = exponent ? std::ldexp(1.0f + mantissa / 8.0f, exponent - 7) : std::ldexp(mantissa / 8.0f, -6);
  if ((bits & 0x7f) == 0x7f) v = NAN;
  return (bits & 0x80 ? -v : v) / kFp8Unit;
}

struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) value[b] = fp8_over_unit(static_cast<uint8_t>(b));
  }
};
const Fp8Table kFp8Table;

inline float weight_value(int8_t q) { return static_cast<float>(q); }
inline float weight_value(Fp8 q) { return kFp8Table.value[q.bits]; }

// The finished sums of `rows` rows of one panel: times the scale, plus the bias, into the
// panel's `cols` (<= 16) columns of out.
inline void finish(const float* sums, int rows, const float* scale, const float* bias, float* out, int64_t ldo,
                   int64_t cols) {
  for (int r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out[r * ldo + c] = sums[r * kCols + c] * scale[c] + (bias ? bias[c] : 0.0f);
}

// Rows in blocks of Block, then the rest in one block of fewer: f(rows, first row), `rows` a
// std::integral_constant so each block size is its own register-blocked instance.
template <int R, typename F>
inline void last_row_block(int64_t rows, F& f, int64_t m) {
  if constexpr (R > 0) {
    if (rows == R) return f(std::integral_constant<int, R>{}, m);
    last_row_block<R - 1>(rows, f, m);
  }
}

template <int Block, typename F>
inline void by_row_blocks(int64_t M, F&& f) {
  int64_t m = 0;
  for (; m + Block <= M; m += Block) f(std::integral_constant<int, Block>{}, m);
  last_row_block<Block - 1>(M - m, f, m);
}

#ifdef SHOAL_HAS_AVX2_INT8
#define SHOAL_AVX2 __attribute__((target("avx2,fma,f16c")))

// The 16 weights of one k, as two vectors of 8 floats.
SHOAL_AVX2 inline __attribute__((always_inline)) void widen(const int8_t* p, __m256& w0, __m256& w1) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
  w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
}

SHOAL_AVX2 inline __attribute__((always_inline)) void widen(const Fp8* p, __m256& w0, __m256& w1) {
  const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8),
                                       _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7f)), 7));
  w0 = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
  w1 = _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
}

SHOAL_AVX2 inline __attribute__((always_inline)) void widen(const float* p, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(p);
  w1 = _mm256_loadu_ps(p + 8);
}

// R rows times one panel. 8-bit: the panel's weights are widened per k (decode: few rows, so
// the weights' bytes from DRAM are what counts); float: a panel widened once beforehand.
template <int R, typename W>
SHOAL_AVX2 inline __attribute__((always_inline)) void block(const float* x, int64_t K, const W* panel,
                                                           const float* scale, const float* bias, float* out,
                                                           int64_t ldo, int64_t cols) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 w0, w1;
    widen(panel + k * kCols, w0, w1);
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
  by_row_blocks<kRows>(M, [&](auto rows, int64_t m) SHOAL_AVX2 {
    block<decltype(rows)::value>(x + m * K, K, panel, scale, bias, out + m * N, N, cols);
  });
}

// One row block: widen as it goes. More: widen the panel once into this thread's buffer
// (K x 64 bytes, inside L2) and run every block on floats, so the widening is paid once per
// panel instead of once per block (at 32 rows that was a third of the time).
template <typename W>
SHOAL_AVX2 void panel_rows(const float* x, int64_t M, int64_t K, const W* panel, const float* scale,
                           const float* bias, float* out, int64_t N, int64_t cols) {
  if (M <= kRows) return rows_of(x, M, K, panel, scale, bias, out, N, cols);
  thread_local std::vector<float> wide;
  wide.resize(K * kCols);
  float* w = wide.data();
  for (int64_t k = 0; k < K; ++k) {
    __m256 w0, w1;
    widen(panel + k * kCols, w0, w1);
    _mm256_storeu_ps(w + k * kCols, w0);
    _mm256_storeu_ps(w + k * kCols + 8, w1);
  }
  rows_of(x, M, K, static_cast<const float*>(w), scale, bias, out, N, cols);
}

// ---- bfloat16 activations (AVX512-BF16) ----
#define SHOAL_BF16 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")))

constexpr int kBf16Rows = 8;  // rows per register block: one 16-column accumulator each

// The 16 weights of one k as 16 floats.
SHOAL_BF16 inline __attribute__((always_inline)) __m512 widen16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

SHOAL_BF16 inline __attribute__((always_inline)) __m512 widen16(const Fp8* p) {
  __m256 w0, w1;
  widen(p, w0, w1);
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(w0)), _mm256_castps_pd(w1), 1));
}

// Weights of k and k + 1 (zero past K), per column side by side: [c0 k, c0 k+1, c1 k, ...].
template <typename W>
SHOAL_BF16 inline __attribute__((always_inline)) __m512i pair_of(const W* panel, int64_t k, int64_t K) {
  alignas(64) static const uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512 lo = widen16(panel + k * kCols);
  const __m512 hi = k + 1 < K ? widen16(panel + (k + 1) * kCols) : _mm512_setzero_ps();
  const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // [lo's 16, hi's 16]
  return _mm512_permutexvar_epi16(_mm512_load_si512(interleave), both);
}

// Up to one block of rows times one panel, its pairs widened as they are read (a decode step's
// few rows: the weights' bytes from DRAM are what counts).
template <int R, typename W>
SHOAL_BF16 inline __attribute__((always_inline)) void bf16_block(const uint16_t* x, int64_t K, const W* panel,
                                                                const float* scale, const float* bias, float* out,
                                                                int64_t ldo, int64_t cols) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    const __m512bh w = reinterpret_cast<__m512bh>(pair_of(panel, k, K));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], reinterpret_cast<__m512bh>(_mm512_set1_epi32(shoal::x_pair(x + r * K, k, K))), w);
  }
  alignas(64) float sums[R * kCols];
  for (int r = 0; r < R; ++r) _mm512_store_ps(sums + r * kCols, acc[r]);
  finish(sums, R, scale, bias, out, ldo, cols);
}

template <typename W>
SHOAL_BF16 void bf16_rows_of(const uint16_t* x, int64_t M, int64_t K, const W* panel, const float* scale,
                             const float* bias, float* out, int64_t N, int64_t cols) {
  by_row_blocks<kBf16Rows>(M, [&](auto rows, int64_t m) SHOAL_BF16 {
    bf16_block<decltype(rows)::value>(x + m * K, K, panel, scale, bias, out + m * N, N, cols);
  });
}

// More rows than one block: kTilePanels panels at a time (`count`, fewer at the end), each
// widened once into this thread's buffer as bf16_tile.h's k-pair panels (K x 32 bytes each,
// inside L2) while the next panels are brought into L2, then every row through its register
// tile. The finished sums take finish()'s scale and bias, as the blocks' do.
template <typename W>
SHOAL_BF16 void bf16_group_rows(const uint16_t* x, int64_t M, int64_t K, const W* panels, int64_t count,
                                const float* scale, const float* bias, float* out, int64_t N, int64_t cols) {
  thread_local std::vector<uint16_t> wide;
  const int64_t stride = (K + 1) / 2 * 2 * kCols;  // elements from one widened panel to the next
  wide.resize(shoal::kTilePanels * stride);
  const char* next = reinterpret_cast<const char*>(panels + count * K * kCols);  // the next group's bytes
  for (int64_t q = 0; q < count; ++q)
    for (int64_t k = 0; k < K; k += 2) {
      if (k % 4 == 0) _mm_prefetch(next + (q * K + k) * kCols * sizeof(W), _MM_HINT_T1);  // read while these compute
      _mm512_storeu_si512(wide.data() + q * stride + k * kCols, pair_of(panels + q * K * kCols, k, K));
    }
  auto finish_sums = [&](int64_t row, int c, __m512 sums) SHOAL_BF16 {
    const int64_t left = std::min<int64_t>(kCols, cols - c * kCols);
    if (left <= 0) return;
    alignas(64) float done[kCols];
    _mm512_store_ps(done, sums);
    finish(done, 1, scale + c * kCols, bias ? bias + c * kCols : nullptr, out + row * N + c * kCols, N, left);
  };
  if (count == shoal::kTilePanels) return shoal::pairs_rows<shoal::kTilePanels>(x, M, K, wide.data(), stride, finish_sums);
  for (int64_t q = 0; q < count; ++q) {
    auto one = [&](int64_t row, int, __m512 sums) SHOAL_BF16 { finish_sums(row, static_cast<int>(q), sums); };
    shoal::pairs_rows<1>(x, M, K, wide.data() + q * stride, stride, one);
  }
}
#endif

template <typename W>
void panel_rows_portable(const float* x, int64_t M, int64_t K, const W* panel, const float* scale,
                         const float* bias, float* out, int64_t N, int64_t cols) {
  float sums[kCols];
  for (int64_t m = 0; m < M; ++m) {
    std::fill(sums, sums + kCols, 0.0f);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < kCols; ++c) sums[c] += x[m * K + k] * weight_value(panel[k * kCols + c]);
    finish(sums, 1, scale, bias, out + m * N, N, cols);
  }
}

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

bool bf16_dot_supported() {
#ifdef SHOAL_HAS_AVX2_INT8
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

template <typename W>
void weight_only_linear(Tensor out, Tensor x, Tensor packed, Tensor scale, Tensor bias, bool portable) {
  constexpr bool fp8 = std::is_same_v<W, Fp8>;
  STD_TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && packed.dim() == 3 && scale.dim() == 1,
                  "x [M, K], out [M, N], packed [P, K, 16], scale [N]");
  for (const Tensor* t : {&out, &scale})
    STD_TORCH_CHECK(t->is_cpu() && t->scalar_type() == ScalarType::Float && t->is_contiguous(),
                    "out and scale must be contiguous float32 CPU tensors");
  const bool bf16 = x.scalar_type() == ScalarType::BFloat16;
  STD_TORCH_CHECK(x.is_cpu() && (bf16 || x.scalar_type() == ScalarType::Float) && x.is_contiguous(),
                  "x must be a contiguous float32 or bfloat16 CPU tensor");
  STD_TORCH_CHECK(!bf16 || (!portable && bf16_dot_supported()),
                  "bfloat16 activations need AVX512-BF16 and the vector path; pass float32");
  STD_TORCH_CHECK(packed.is_cpu() && packed.scalar_type() == (fp8 ? ScalarType::Byte : ScalarType::Char) &&
                      packed.is_contiguous(),
                  fp8 ? "packed must be a contiguous CPU tensor of e4m3 bytes (uint8)"
                      : "packed must be a contiguous int8 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), panels = packed.size(0);
  STD_TORCH_CHECK(out.size(0) == M && packed.size(1) == K && packed.size(2) == kCols &&
                      panels == (N + kCols - 1) / kCols && scale.numel() == N,
                  "shapes of out, x, packed and scale do not agree");
  const bool has_bias = bias.numel() > 0;
  STD_TORCH_CHECK(!has_bias || (bias.is_cpu() && bias.scalar_type() == ScalarType::Float &&
                                bias.is_contiguous() && bias.numel() == N),
                  "bias must be empty or a contiguous float32 [N]");
  if (M == 0) return;
  const W* wp = reinterpret_cast<const W*>(packed.const_data_ptr());
  const float* sp = scale.const_data_ptr<float>();
  std::vector<float> unit_scale;  // fp8: the scale times 256 (a power of two: exact)
  if constexpr (fp8) {
    unit_scale.assign(sp, sp + N);
    for (float& s : unit_scale) s *= kFp8Unit;
    sp = unit_scale.data();
  }
  const float* bp = has_bias ? bias.const_data_ptr<float>() : nullptr;
  float* op = out.mutable_data_ptr<float>();
  // Every panel's rows, in parallel over panels, through `rows` (x's element type its own).
  auto each_panel = [&](auto rows, const auto* xp) {
    torch::stable::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p)
        rows(xp, M, K, wp + p * K * kCols, sp + p * kCols, bp ? bp + p * kCols : nullptr, op + p * kCols, N,
             std::min<int64_t>(kCols, N - p * kCols));
    });
  };
#ifdef SHOAL_HAS_AVX2_INT8
  if (bf16) {
    const auto* xb = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
    if (M <= kBf16Rows) return each_panel(bf16_rows_of<W>, xb);  // one block: widen as it goes
    const int64_t groups = (panels + shoal::kTilePanels - 1) / shoal::kTilePanels;
    return torch::stable::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p = g * shoal::kTilePanels, count = std::min<int64_t>(shoal::kTilePanels, panels - p);
        bf16_group_rows(xb, M, K, wp + p * K * kCols, count, sp + p * kCols, bp ? bp + p * kCols : nullptr,
                        op + p * kCols, N, std::min<int64_t>(count * kCols, N - p * kCols));
      }
    });
  }
#endif
  auto rows = panel_rows_portable<W>;
#ifdef SHOAL_HAS_AVX2_INT8
  if (!portable && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      (!fp8 || __builtin_cpu_supports("f16c")))
    rows = panel_rows<W>;
#endif
  each_panel(rows, x.const_data_ptr<float>());
}

void int8_linear(Tensor out, Tensor x, Tensor packed, Tensor scale, Tensor bias, bool portable) {
  weight_only_linear<int8_t>(out, x, packed, scale, bias, portable);
}

void fp8_linear(Tensor out, Tensor x, Tensor packed, Tensor scale, Tensor bias, bool portable) {
  weight_only_linear<Fp8>(out, x, packed, scale, bias, portable);
}

// ---- w8a8_sums ----

constexpr int64_t kGroup = 4;     // k's of one int32 lane: vpmaddubsw + vpmaddwd sum 4 products
constexpr int64_t kSumRows = 4;   // rows per register block: 4 x 2 int32 accumulators

// The finished int32 sums of `rows` rows of one panel, as float32, into its `cols` columns.
inline void store_sums(const int32_t* sums, int rows, float* out, int64_t ldo, int64_t cols) {
  for (int r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * ldo + c] = static_cast<float>(sums[r * kCols + c]);
}

#ifdef SHOAL_HAS_AVX2_INT8
template <int R>
SHOAL_AVX2 inline __attribute__((always_inline)) void sums_block(const int8_t* x, int64_t K, const int8_t* panel,
                                                                float* out, int64_t ldo, int64_t cols) {
  __m256i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t k = 0; k < K; k += kGroup) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k * kCols));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k * kCols + 32));
    const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);  // (-128 -> 128 as u8)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, x + r * K + k, sizeof four);
      const __m256i xs = _mm256_set1_epi32(four);  // the row's 4 k's, in every lane
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(xs, w0)), ones));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(xs, w1)), ones));
    }
  }
  alignas(32) int32_t sums[R * kCols];
  for (int r = 0; r < R; ++r) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums + r * kCols), acc[r][0]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums + r * kCols + 8), acc[r][1]);
  }
  store_sums(sums, R, out, ldo, cols);
}

SHOAL_AVX2 void panel_sums(const int8_t* x, int64_t M, int64_t K, const int8_t* panel, float* out, int64_t N,
                           int64_t cols) {
  int64_t m = 0;
  for (; m + kSumRows <= M; m += kSumRows) sums_block<kSumRows>(x + m * K, K, panel, out + m * N, N, cols);
  switch (M - m) {
    case 1: sums_block<1>(x + m * K, K, panel, out + m * N, N, cols); break;
    case 2: sums_block<2>(x + m * K, K, panel, out + m * N, N, cols); break;
    case 3: sums_block<3>(x + m * K, K, panel, out + m * N, N, cols); break;
    default: break;
  }
}
#endif

#ifdef SHOAL_HAS_AVX2_INT8
// ---- AVX512-VNNI ----
// vpdpbusd multiplies 4 u8 by 4 s8 and adds them to an int32 lane, exactly (no 16-bit
// intermediate, so nothing saturates): 64 products per instruction against AVX2's 16 in two.
// The weights go in as u8 w + 128 (their top bit flipped as they are loaded), the activations
// as they are, broadcast from memory; 128 x each row's sum of activations comes off at the end:
// sum (w + 128) q - 128 sum q = sum q w, in int32.
#define SHOAL_VNNI __attribute__((target("avx2,avx512f,avx512bw,avx512vl,avx512vnni")))
constexpr int kVnniRows = 8;    // rows per register tile
constexpr int kVnniPanels = 2;  // panels per register tile: 8 x 2 accumulators

// A tile of R rows x C panels. While it runs from cache, it prefetches a line of the next
// panels per group of k's, from `ahead` up to `ahead_end` (what it leaves, the next tile takes).
template <int R, int C>
SHOAL_VNNI inline __attribute__((always_inline)) void vnni_tile(const int8_t* x, int64_t K, const int8_t* panels,
                                                                const int32_t* offset, float* out, int64_t ldo,
                                                                int64_t cols, const int8_t*& ahead,
                                                                const int8_t* ahead_end) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += kGroup) {
    if (ahead < ahead_end) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
      ahead += 64;
    }
    __m512i w[C];
    for (int c = 0; c < C; ++c) w[c] = _mm512_xor_si512(_mm512_loadu_si512(panels + c * K * kCols + k * kCols), flip);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, x + r * K + k, sizeof four);
      const __m512i xs = _mm512_set1_epi32(four);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], w[c], xs);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512i off = _mm512_set1_epi32(offset[r]);
    for (int c = 0; c < C; ++c) {
      const int64_t n = std::min<int64_t>(kCols, cols - c * kCols);
      if (n <= 0) break;
      _mm512_mask_storeu_ps(out + r * ldo + c * kCols, static_cast<__mmask16>((1u << n) - 1),
                            _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][c], off)));
    }
  }
}

// Every row of x times C panels (`cols` of their columns are real); offset[m] = 128 x row m's sum.
// The first tile reads the panels from memory; the later ones, from cache, fetch the `next`
// bytes (this thread's next panels) meanwhile, so those do not wait for memory in their turn.
template <int C>
SHOAL_VNNI void vnni_panels(const int8_t* x, const int32_t* offset, int64_t M, int64_t K, const int8_t* panels,
                            float* out, int64_t N, int64_t cols, int64_t next) {
  const int8_t* const end = panels + C * K * kCols;
  const int8_t* ahead = end;
  const int8_t* ahead_end = end;  // nothing to fetch in the first tile
  by_row_blocks<kVnniRows>(M, [&](auto rows, int64_t m) SHOAL_VNNI {
    vnni_tile<decltype(rows)::value, C>(x + m * K, K, panels, offset + m, out + m * N, N, cols, ahead, ahead_end);
    ahead_end = end + next;
  });
}

bool vnni_supported() {
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}
#endif

void panel_sums_portable(const int8_t* x, int64_t M, int64_t K, const int8_t* panel, float* out, int64_t N,
                         int64_t cols) {
  int32_t sums[kCols];
  for (int64_t m = 0; m < M; ++m) {
    std::fill(sums, sums + kCols, 0);
    for (int64_t k = 0; k < K; k += kGroup)
      for (int64_t c = 0; c < kCols; ++c)
        for (int64_t j = 0; j < kGroup; ++j)
          sums[c] += int32_t{x[m * K + k + j]} * int32_t{panel[k * kCols + c * kGroup + j]};
    store_sums(sums, 1, out + m * N, N, cols);
  }
}

// path: 0 the widest the CPU has, 1 AVX2 at most, 2 the portable loop.
void w8a8_sums(Tensor out, Tensor xq, Tensor packed, int64_t path) {
  STD_TORCH_CHECK(xq.dim() == 2 && out.dim() == 2 && packed.dim() == 4, "xq [M, K], out [M, N], packed [P, K / 4, 16, 4]");
  STD_TORCH_CHECK(out.is_cpu() && out.scalar_type() == ScalarType::Float && out.is_contiguous(),
                  "out must be a contiguous float32 CPU tensor");
  for (const Tensor* t : {&xq, &packed})
    STD_TORCH_CHECK(t->is_cpu() && t->scalar_type() == ScalarType::Char && t->is_contiguous(),
                    "xq and packed must be contiguous int8 CPU tensors");
  const int64_t M = xq.size(0), K = xq.size(1), N = out.size(1), panels = packed.size(0);
  STD_TORCH_CHECK(out.size(0) == M && K % kGroup == 0 && packed.size(1) * kGroup == K && packed.size(2) == kCols &&
                      packed.size(3) == kGroup && panels == (N + kCols - 1) / kCols,
                  "shapes of out, xq and packed do not agree (K must be a multiple of 4)");
  if (M == 0) return;
  const int8_t* xp = xq.const_data_ptr<int8_t>();
  const int8_t* wp = packed.const_data_ptr<int8_t>();
  float* op = out.mutable_data_ptr<float>();
#ifdef SHOAL_HAS_AVX2_INT8
  if (path == 0 && vnni_supported()) {
    std::vector<int32_t> offset(static_cast<size_t>(M));  // 128 x each row's sum
    for (int64_t m = 0; m < M; ++m) {
      int32_t sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += xp[m * K + k];
      offset[m] = sum * 128;
    }
    const int64_t groups = (panels + kVnniPanels - 1) / kVnniPanels;
    torch::stable::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      const int64_t last = std::min(end * kVnniPanels, panels);  // this thread's panels end here
      for (int64_t g = begin; g < end; ++g) {
        int64_t p = g * kVnniPanels;
        if (p + kVnniPanels <= panels) {
          const int64_t next = std::min<int64_t>(kVnniPanels, last - p - kVnniPanels) * K * kCols;
          vnni_panels<kVnniPanels>(xp, offset.data(), M, K, wp + p * K * kCols, op + p * kCols, N,
                                   std::min<int64_t>(kVnniPanels * kCols, N - p * kCols), next);
          continue;
        }
        for (; p < panels; ++p)  // the last panels, one at a time
          vnni_panels<1>(xp, offset.data(), M, K, wp + p * K * kCols, op + p * kCols, N,
                         std::min<int64_t>(kCols, N - p * kCols), std::min<int64_t>(1, last - p - 1) * K * kCols);
      }
    });
    return;
  }
#endif
  auto sums = panel_sums_portable;
#ifdef SHOAL_HAS_AVX2_INT8
  if (path <= 1 && __builtin_cpu_supports("avx2")) sums = panel_sums;
#endif
  torch::stable::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      sums(xp, M, K, wp + p * K * kCols, op + p * kCols, N, std::min<int64_t>(kCols, N - p * kCols));
  });
}

}  // namespace

STABLE_TORCH_LIBRARY(shoal_int8, m) {
  m.def("int8_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor scale, Tensor bias, bool portable) -> ()");
  m.def("fp8_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor scale, Tensor bias, bool portable) -> ()");
  m.def("w8a8_sums(Tensor(a!) out, Tensor xq, Tensor packed, int path) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(shoal_int8, CPU, m) {
  m.impl("int8_linear", TORCH_BOX(&int8_linear));
  m.impl("fp8_linear", TORCH_BOX(&fp8_linear));
  m.impl("w8a8_sums", TORCH_BOX(&w8a8_sums));
}
