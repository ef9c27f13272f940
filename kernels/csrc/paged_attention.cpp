// Paged decode attention on CPU: every decode row reads its keys and values straight from
// the paged KV pool (no gather copy); parallel over (batch row, range of kv heads).
//
//   out[b, h] = softmax(scale * q[b, h] . K[b, :n_b]) @ V[b, :n_b],   h in the kv head's group
//   K[b, t] = k_cache[block_tables[b, t / block_size] * block_size + t % block_size, h / group]
//
// Optionally (Gemma, Mistral, ...): scores soft-capped to cap * tanh(s / cap), and a sliding
// window, where a row sees only its last `window` keys. Optionally (gpt-oss) attention sinks:
// one float32 logit per query head that joins each softmax's max and denominator as a key with
// no value (out = sum_t e^(s_t - m) v_t / (sum_t e^(s_t - m) + e^(sink - m))).
//
// float32 / bfloat16 / float16 caches of the queries' dtype, or float8 e4m3 caches
// (--kv-cache-dtype fp8) with one K and one V scale: each e4m3 byte is read as its value times
// the scale, in float32 (a 256-entry table in the portable loop; in the vector paths the byte's
// exponent and mantissa go where a float16's go, then times 2^8 x scale), so the kernel on an
// fp8 pool computes exactly what it computes on float32 K/V holding those values. All arithmetic
// is float32. No -ffast-math: the result stays within ~1e-6 of torch's
// scaled_dot_product_attention.
//
// Three implementations of one task: on a CPU with AVX-512 (and head_dim a multiple of 16) an
// explicit one that scores 16 keys at a time and exponentiates 16 scores at a time; with AVX2
// and FMA (head_dim a multiple of 8) the same 8 lanes wide; elsewhere a portable loop that the
// compiler vectorises (one dot product per key, scalar exp). Two more ops hold a CPU to a
// narrower path (paged_decode_attention_avx2: at most AVX2; _portable: the loop), so one
// machine runs and tests every path it can execute (kernels/native.py, SHOAL_CPU_ATTENTION).
//
// Built against torch's stable C++ API (torch/csrc/stable): its headers compile in seconds,
// where torch/extension.h takes ~45 s. Registered as torch.ops.shoal.paged_decode_attention.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif
#include <limits>
#include <optional>
#include <vector>

namespace {

// One build runs on any x86-64: GCC emits an AVX-512, an AVX2+FMA and a baseline copy of the
// per-task loop and picks one when the library loads (ifunc), so no -march flag is needed.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SHOAL_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SHOAL_MULTIVERSION
#endif
// Helpers are forced inline so they are compiled with the instruction set of each clone.
#define SHOAL_INLINE inline __attribute__((always_inline))

constexpr int kLanes = 16;

// One float8 e4m3 byte of an fp8 KV cache (sign, 4 exponent bits of bias 7, 3 mantissa bits).
struct Fp8 {
  uint8_t bits;
};

// Every e4m3 byte's value (0x7f / 0xff are NaN; writes saturate, so the pool never holds them).
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float v = e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(m / 8.0f, -6);
      if (e == 15 && m == 7) v = std::numeric_limits<float>::quiet_NaN();
      value[b] = (b & 0x80) ? -v : v;
    }
  }
};
const Fp8Table kFp8;

// T: the queries' and output's dtype; C: the caches' (T, or Fp8).
template <typename T, typename C>
struct Args {
  const T* q;
  const C* k;
  const C* v;
  T* out;
  const int64_t* tables;
  const int32_t* lens;
  int64_t q_s0, q_s1, o_s0, o_s1, kv_s0, kv_s1, table_s0;  // strides, in elements
  int64_t heads, kv_heads, d, block_size;
  float scale;
  int64_t window;  // > 0: each row sees only its last `window` keys
  float softcap;   // > 0: scores become softcap * tanh(score / softcap)
  const float* sinks;  // [heads] or nullptr
  float k_scale, v_scale;  // an fp8 cache's scales (1 for float caches)
};

// The sink of query head h, or -inf (no weight) without sinks: the softmax's max starts from it.
template <typename T, typename C>
SHOAL_INLINE float sink_of(const Args<T, C>& a, int64_t h) {
  return a.sinks ? a.sinks[h] : -std::numeric_limits<float>::infinity();
}

// The sink's share of a softmax denominator whose max is `mx` (0 without sinks).
template <typename T, typename C>
SHOAL_INLINE float sink_weight(const Args<T, C>& a, int64_t h, float mx) {
  return a.sinks ? std::exp(a.sinks[h] - mx) : 0.0f;
}

// A K/V row as float32: fp32 rows are used in place, 16-bit rows are widened into `buf`, fp8
// rows are looked up and scaled into `buf` (the scale is 1 for the float caches).
SHOAL_INLINE const float* as_float(const float* src, float*, int64_t, float = 1.0f) { return src; }

SHOAL_INLINE const float* as_float(const Fp8* src, float* buf, int64_t d, float scale) {
  for (int64_t i = 0; i < d; ++i) buf[i] = kFp8.value[src[i].bits] * scale;
  return buf;
}

SHOAL_INLINE const float* as_float(const c10::BFloat16* src, float* buf, int64_t d, float = 1.0f) {
  // bfloat16 is the top half of a float32: a shift, which vectorises.
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < d; ++i) {
    uint32_t bits = uint32_t(s[i]) << 16;
    std::memcpy(buf + i, &bits, sizeof(float));
  }
  return buf;
}

SHOAL_INLINE const float* as_float(const c10::Half* src, float* buf, int64_t d, float = 1.0f) {
  for (int64_t i = 0; i < d; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}

// Dot product with kLanes independent partial sums, so the compiler vectorises it without
// reassociating float additions (which it may not do without -ffast-math); the partial sums
// are then folded pairwise, also vector-wide.
SHOAL_INLINE float dot(const float* a, const float* b, int64_t d) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  for (int l = 0; i < d; ++i, ++l) acc[l] += a[i] * b[i];
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// Calls fn(t, slot) for the first n tokens of a row, walking its block table a block at a
// time (entries past the last used block are padding and never read). Blocks are scattered
// through the pool, so the hardware prefetcher cannot guess the next one: the row data
// kPrefetch tokens ahead is prefetched by hand (1.5-1.8x on a pool that misses the cache).
constexpr int64_t kPrefetch = 16;

template <typename T, typename C, typename F>
SHOAL_INLINE void for_each_slot(const Args<T, C>& a, const int64_t* table, int64_t n,
                                const C* base, int64_t row_bytes, F fn) {
  for (int64_t t0 = 0, j = 0; t0 < n; t0 += a.block_size, ++j) {
    const int64_t m = std::min(a.block_size, n - t0);
    for (int64_t o = 0; o < m; ++o) {
      const int64_t ahead = t0 + o + kPrefetch;
      if (ahead < n) {
        const int64_t slot = table[ahead / a.block_size] * a.block_size + ahead % a.block_size;
        const char* p = reinterpret_cast<const char*>(base + slot * a.kv_s0);
        for (int64_t i = 0; i < row_bytes; i += 64) __builtin_prefetch(p + i);
      }
      fn(t0 + o, table[j] * a.block_size + o);
    }
  }
}

// A task's start, shared by every path: false (after writing zeros) for a row with nothing
// to attend to (the engine never sends one), else the task's queries as float32 in qf
// ([nh, d]); `row` is a [d] buffer for widening 16-bit queries.
template <typename T, typename C>
SHOAL_INLINE bool load_queries(const Args<T, C>& a, int64_t b, int64_t h0, int64_t nh, float* qf, float* row) {
  if (a.lens[b] <= 0) {  // zeros, not NaN
    T* out = a.out + b * a.o_s0;
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t i = 0; i < a.d; ++i) out[(h0 + h) * a.o_s1 + i] = T(0.0f);
    return false;
  }
  for (int64_t h = 0; h < nh; ++h) {
    const float* src = as_float(a.q + b * a.q_s0 + (h0 + h) * a.q_s1, row, a.d);
    std::memcpy(qf + h * a.d, src, a.d * sizeof(float));
  }
  return true;
}

// A task's end, shared by every path: the accumulators ([nh, d]) into the output row.
template <typename T, typename C>
SHOAL_INLINE void store_out(const Args<T, C>& a, int64_t b, int64_t h0, int64_t nh, const float* acc) {
  T* out = a.out + b * a.o_s0;
  for (int64_t h = 0; h < nh; ++h)
    for (int64_t i = 0; i < a.d; ++i) out[(h0 + h) * a.o_s1 + i] = T(acc[h * a.d + i]);
}

// Prefetches the first rows of a row's next block (its kv heads' run of each slot) for the
// vector paths, which walk a block at a time: blocks are scattered through the pool, so the
// hardware prefetcher cannot guess the next one.
template <typename T, typename C>
SHOAL_INLINE void prefetch_block(const Args<T, C>& a, const C* base, int64_t block, int64_t rows, int64_t row_bytes) {
  const char* p = reinterpret_cast<const char*>(base + block * a.block_size * a.kv_s0);
  for (int64_t r = 0; r < std::min<int64_t>(rows, 16); ++r, p += a.kv_s0 * int64_t(sizeof(C)))
    for (int64_t i = 0; i < row_bytes; i += 64) __builtin_prefetch(p + i);
}

// Soft-capping and the sliding window, applied to pass 1's scores (all implementations). Keys
// before the window get -inf, so the softmax gives them no weight; they are still scored,
// which costs time only for rows longer than their window.
template <typename T, typename C>
SHOAL_INLINE void shape_scores(const Args<T, C>& a, float* s, int64_t nh, int64_t n) {
  const int64_t hidden = a.window > 0 ? std::max<int64_t>(0, n - a.window) : 0;
  if (a.softcap <= 0.0f && hidden == 0) return;
  for (int64_t h = 0; h < nh; ++h) {
    float* sh = s + h * n;
    std::fill(sh, sh + hidden, -std::numeric_limits<float>::infinity());
    if (a.softcap > 0.0f)
      for (int64_t t = hidden; t < n; ++t) sh[t] = a.softcap * std::tanh(sh[t] / a.softcap);
  }
}

// One task: batch row b, kv heads [kh0, kh1) and the query heads they serve. Going through
// the tokens once for all those heads reads each token's K (then V) as one contiguous run
// (~1.4x faster than one kv head per task), and each K/V row serves its whole GQA group.
// Two passes: scores into the workspace, a max-subtracted softmax, then the sum of V rows.
template <typename T, typename C>
SHOAL_INLINE void attend(const Args<T, C>& a, int64_t b, int64_t kh0, int64_t kh1, float* ws) {
  const int64_t d = a.d, group = a.heads / a.kv_heads, n = a.lens[b];
  const int64_t h0 = kh0 * group, nh = (kh1 - kh0) * group;  // query heads of this task
  float* qf = ws;             // [nh, d] queries in float32
  float* acc = qf + nh * d;   // [nh, d] output accumulators
  float* row = acc + nh * d;  // [d] one widened K/V row
  float* s = row + d;         // [nh, n] scores, then probabilities
  const int64_t* table = a.tables + b * a.table_s0;
  const int64_t row_bytes = (kh1 - kh0) * a.kv_s1 * int64_t(sizeof(C));
  if (!load_queries(a, b, h0, nh, qf, row)) return;

  // Pass 1: scaled scores q . k for every key; kv head kh serves query heads [kh*group, +group).
  for_each_slot(a, table, n, a.k + kh0 * a.kv_s1, row_bytes, [&](int64_t t, int64_t slot) {
    for (int64_t kh = kh0, h = 0; kh < kh1; ++kh) {
      const float* k = as_float(a.k + slot * a.kv_s0 + kh * a.kv_s1, row, d, a.k_scale);
      for (int64_t g = 0; g < group; ++g, ++h) s[h * n + t] = dot(qf + h * d, k, d) * a.scale;
    }
  });

  shape_scores(a, s, nh, n);

  // Softmax per query head, numerically stable: exp(x - max) <= 1.
  for (int64_t h = 0; h < nh; ++h) {
    float* sh = s + h * n;
    float mx = sink_of(a, h0 + h);
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sh[t]);
    float sum = sink_weight(a, h0 + h, mx);
    for (int64_t t = 0; t < n; ++t) {
      sh[t] = std::exp(sh[t] - mx);
      sum += sh[t];
    }
    const float inv = 1.0f / sum;
    for (int64_t t = 0; t < n; ++t) sh[t] *= inv;
  }

  // Pass 2: acc = sum_t p_t * v_t, a plain axpy per row (vectorised).
  std::fill(acc, acc + nh * d, 0.0f);
  for_each_slot(a, table, n, a.v + kh0 * a.kv_s1, row_bytes, [&](int64_t t, int64_t slot) {
    for (int64_t kh = kh0, h = 0; kh < kh1; ++kh) {
      const float* v = as_float(a.v + slot * a.kv_s0 + kh * a.kv_s1, row, d, a.v_scale);
      for (int64_t g = 0; g < group; ++g, ++h) {
        const float p = s[h * n + t];
        float* ah = acc + h * d;
        for (int64_t i = 0; i < d; ++i) ah[i] += p * v[i];
      }
    }
  });
  store_out(a, b, h0, nh, acc);
}


#if defined(__x86_64__) && defined(__GNUC__)
#define SHOAL_HAS_VECTOR_PATHS 1
// Every function here is compiled for AVX-512 (and inlined into avx512_task).
#define SHOAL_AVX512 inline __attribute__((always_inline, target("avx512f,fma,f16c")))

// 16 K/V elements as float32 (the scale: an fp8 cache's, 1 for the float caches).
SHOAL_AVX512 __m512 load16(const float* p, float) { return _mm512_loadu_ps(p); }
SHOAL_AVX512 __m512 load16(const Fp8* p, float scale) {  // e4m3 -> float16 bits (exact), x 2^8 x scale
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f * scale));
}
SHOAL_AVX512 __m512 load16(const c10::BFloat16* p, float) {  // bfloat16 -> float32: a 16-bit shift
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
SHOAL_AVX512 __m512 load16(const c10::Half* p, float) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The 16 horizontal sums of a[0..15] as one vector (lane t = sum of a[t]'s lanes), by a
// transpose-add tree: 45 shuffles and adds for 16 dot products where reducing each on its
// own takes 8 dependent steps apiece.
SHOAL_AVX512 __m512 sum16(const __m512* a) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the 4 keys' sums over that lane
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(x[2 * i]), _mm512_castps_pd(x[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(x[2 * i]), _mm512_castps_pd(x[2 * i + 1]));
    y[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  constexpr int even = _MM_SHUFFLE(2, 0, 2, 0), odd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], even), _mm512_shuffle_f32x4(y[0], y[1], odd));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], even), _mm512_shuffle_f32x4(y[2], y[3], odd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, even), _mm512_shuffle_f32x4(s01, s23, odd));
}

// exp(x) for x <= 0 (max-subtracted scores), Cephes' expf: a degree-6 polynomial on
// x - n ln2, scaled by 2^n; within ~2 ulp of std::exp.
SHOAL_AVX512 __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));  // below this exp underflows to ~0 anyway
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// The same task as attend(): scores 16 keys at a time (sum16), softmax with exp16, then the
// sum of V rows. The workspace layout is attend()'s.
template <typename T, typename C>
__attribute__((target("avx512f,fma,f16c"))) void avx512_task(const Args<T, C>& a, int64_t b, int64_t kh0,
                                                             int64_t kh1, float* ws) {
  const int64_t d = a.d, group = a.heads / a.kv_heads, n = a.lens[b];
  const int64_t h0 = kh0 * group, nh = (kh1 - kh0) * group;
  float* qf = ws;
  float* acc = qf + nh * d;
  float* s = acc + nh * d + d;  // the workspace layout of attend()
  const int64_t* table = a.tables + b * a.table_s0;
  const int64_t row_bytes = (kh1 - kh0) * a.kv_s1 * int64_t(sizeof(C));
  const int64_t blocks = (n + a.block_size - 1) / a.block_size;
  if (!load_queries(a, b, h0, nh, qf, acc)) return;
  const __m512 scale = _mm512_set1_ps(a.scale);

  // Pass 1: scores, 16 consecutive slots of a block at a time. Slots past the row's end read
  // the last real slot again (in bounds) and their lanes are not stored.
  const C* k_base = a.k + kh0 * a.kv_s1;
  for (int64_t j = 0; j < blocks; ++j) {
    if (j + 1 < blocks) prefetch_block(a, k_base, table[j + 1], n - (j + 1) * a.block_size, row_bytes);
    const int64_t first = j * a.block_size, m = std::min(a.block_size, n - first);
    for (int64_t o0 = 0; o0 < m; o0 += 16) {
      const int64_t valid = std::min<int64_t>(16, m - o0);
      const C* rows[16];
      for (int t = 0; t < 16; ++t)
        rows[t] = k_base + (table[j] * a.block_size + o0 + std::min<int64_t>(t, valid - 1)) * a.kv_s0;
      const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
      for (int64_t kh = 0, h = 0; kh < kh1 - kh0; ++kh) {
        for (int64_t g = 0; g < group; ++g, ++h) {
          __m512 dots[16];
          for (int t = 0; t < 16; ++t) dots[t] = _mm512_setzero_ps();
          for (int64_t i = 0; i < d; i += 16) {
            const __m512 qi = _mm512_loadu_ps(qf + h * d + i);
#pragma GCC unroll 16
            for (int t = 0; t < 16; ++t) dots[t] = _mm512_fmadd_ps(qi, load16(rows[t] + kh * a.kv_s1 + i, a.k_scale), dots[t]);
          }
          _mm512_mask_storeu_ps(s + h * n + first + o0, keep, _mm512_mul_ps(sum16(dots), scale));
        }
      }
    }
  }

  shape_scores(a, s, nh, n);

  // Softmax per query head, 16 scores at a time (masked at the end).
  for (int64_t h = 0; h < nh; ++h) {
    float* sh = s + h * n;
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < n; t += 16) {
      const __mmask16 keep = static_cast<__mmask16>(n - t >= 16 ? 0xFFFF : (1u << (n - t)) - 1);
      mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, keep, sh + t));
    }
    const float top_value = std::max(_mm512_reduce_max_ps(mx), sink_of(a, h0 + h));
    const __m512 top = _mm512_set1_ps(top_value);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
      const __mmask16 keep = static_cast<__mmask16>(n - t >= 16 ? 0xFFFF : (1u << (n - t)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, sh + t), top)));
      _mm512_mask_storeu_ps(sh + t, keep, e);
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / (_mm512_reduce_add_ps(sum) + sink_weight(a, h0 + h, top_value)));
    for (int64_t t = 0; t < n; t += 16) {
      const __mmask16 keep = static_cast<__mmask16>(n - t >= 16 ? 0xFFFF : (1u << (n - t)) - 1);
      _mm512_mask_storeu_ps(sh + t, keep, _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, sh + t), inv));
    }
  }

  // Pass 2: acc = sum_t p_t * v_t.
  std::fill(acc, acc + nh * d, 0.0f);
  const C* v_base = a.v + kh0 * a.kv_s1;
  for (int64_t j = 0; j < blocks; ++j) {
    if (j + 1 < blocks) prefetch_block(a, v_base, table[j + 1], n - (j + 1) * a.block_size, row_bytes);
    const int64_t first = j * a.block_size, m = std::min(a.block_size, n - first);
    for (int64_t o = 0; o < m; ++o) {
      const C* row = v_base + (table[j] * a.block_size + o) * a.kv_s0;
      for (int64_t kh = 0, h = 0; kh < kh1 - kh0; ++kh) {
        for (int64_t i = 0; i < d; i += 16) {
          const __m512 vi = load16(row + kh * a.kv_s1 + i, a.v_scale);
          for (int64_t g = 0; g < group; ++g) {
            float* ah = acc + (h + g) * d + i;
            _mm512_storeu_ps(ah, _mm512_fmadd_ps(_mm512_set1_ps(s[(h + g) * n + first + o]), vi, _mm512_loadu_ps(ah)));
          }
        }
        h += group;
      }
    }
  }
  store_out(a, b, h0, nh, acc);
}

bool avx512_path(int64_t d) {
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("f16c");
  return cpu && d % 16 == 0;
}

// ---- AVX2 + FMA: the same task 8 lanes wide (the AMD EPYCs and older Intel CPUs) ----------
#define SHOAL_AVX2 inline __attribute__((always_inline, target("avx2,fma,f16c")))

SHOAL_AVX2 __m256 load8(const float* p, float) { return _mm256_loadu_ps(p); }
SHOAL_AVX2 __m256 load8(const Fp8* p, float scale) {  // as load16's
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f * scale));
}
SHOAL_AVX2 __m256 load8(const c10::BFloat16* p, float) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
SHOAL_AVX2 __m256 load8(const c10::Half* p, float) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The 8 horizontal sums of a[0..7] as one vector (lane t = sum of a[t]'s lanes): two rounds
// of pairwise adds, then the 128-bit halves.
SHOAL_AVX2 __m256 sum8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

SHOAL_AVX2 float lane_sum(__m256 x) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}
SHOAL_AVX2 float lane_max(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// exp(x) for x <= 0: exp16's polynomial, scaled by 2^n through the exponent bits (n >= -126
// after the clamp, so 2^n is a normal float).
SHOAL_AVX2 __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}

// The same task as attend(): scores 8 keys at a time (sum8), softmax with exp8, then the sum
// of V rows 4 tokens at a time (each accumulator loaded and stored once per 4 rows, the
// additions in token order as in attend()).
template <typename T, typename C>
__attribute__((target("avx2,fma,f16c"))) void avx2_task(const Args<T, C>& a, int64_t b, int64_t kh0,
                                                        int64_t kh1, float* ws) {
  const int64_t d = a.d, group = a.heads / a.kv_heads, n = a.lens[b];
  const int64_t h0 = kh0 * group, nh = (kh1 - kh0) * group;
  float* qf = ws;
  float* acc = qf + nh * d;
  float* s = acc + nh * d + d;  // the workspace layout of attend()
  const int64_t* table = a.tables + b * a.table_s0;
  const int64_t row_bytes = (kh1 - kh0) * a.kv_s1 * int64_t(sizeof(C));
  const int64_t blocks = (n + a.block_size - 1) / a.block_size;
  if (!load_queries(a, b, h0, nh, qf, acc)) return;
  const __m256 scale = _mm256_set1_ps(a.scale);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);

  // Pass 1: scores, 8 consecutive slots of a block at a time. Slots past the block's end read
  // the last real slot again (in bounds) and their lanes are not stored.
  const C* k_base = a.k + kh0 * a.kv_s1;
  for (int64_t j = 0; j < blocks; ++j) {
    if (j + 1 < blocks) prefetch_block(a, k_base, table[j + 1], n - (j + 1) * a.block_size, row_bytes);
    const int64_t first = j * a.block_size, m = std::min(a.block_size, n - first);
    for (int64_t o0 = 0; o0 < m; o0 += 8) {
      const int64_t valid = std::min<int64_t>(8, m - o0);
      const C* rows[8];
      for (int t = 0; t < 8; ++t)
        rows[t] = k_base + (table[j] * a.block_size + o0 + std::min<int64_t>(t, valid - 1)) * a.kv_s0;
      const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(valid)), lane);
      for (int64_t kh = 0, h = 0; kh < kh1 - kh0; ++kh) {
        for (int64_t g = 0; g < group; ++g, ++h) {
          __m256 dots[8];
          for (int t = 0; t < 8; ++t) dots[t] = _mm256_setzero_ps();
          for (int64_t i = 0; i < d; i += 8) {
            const __m256 qi = _mm256_loadu_ps(qf + h * d + i);
#pragma GCC unroll 8
            for (int t = 0; t < 8; ++t) dots[t] = _mm256_fmadd_ps(qi, load8(rows[t] + kh * a.kv_s1 + i, a.k_scale), dots[t]);
          }
          _mm256_maskstore_ps(s + h * n + first + o0, keep, _mm256_mul_ps(sum8(dots), scale));
        }
      }
    }
  }

  shape_scores(a, s, nh, n);

  // Softmax per query head, 8 scores at a time, the last n % 8 one by one.
  for (int64_t h = 0; h < nh; ++h) {
    float* sh = s + h * n;
    const int64_t whole = n - n % 8;
    __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < whole; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sh + t));
    float top = std::max(lane_max(mx), sink_of(a, h0 + h));
    for (int64_t t = whole; t < n; ++t) top = std::max(top, sh[t]);
    const __m256 vtop = _mm256_set1_ps(top);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t t = 0; t < whole; t += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + t), vtop));
      _mm256_storeu_ps(sh + t, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    float sum = lane_sum(vsum) + sink_weight(a, h0 + h, top);
    for (int64_t t = whole; t < n; ++t) {
      sh[t] = std::exp(sh[t] - top);
      sum += sh[t];
    }
    const float inv = 1.0f / sum;
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int64_t t = 0; t < whole; t += 8) _mm256_storeu_ps(sh + t, _mm256_mul_ps(_mm256_loadu_ps(sh + t), vinv));
    for (int64_t t = whole; t < n; ++t) sh[t] *= inv;
  }

  // Pass 2: acc = sum_t p_t * v_t, 4 tokens of a block at a time, then the block's rest.
  std::fill(acc, acc + nh * d, 0.0f);
  const C* v_base = a.v + kh0 * a.kv_s1;
  for (int64_t j = 0; j < blocks; ++j) {
    if (j + 1 < blocks) prefetch_block(a, v_base, table[j + 1], n - (j + 1) * a.block_size, row_bytes);
    const int64_t first = j * a.block_size, m = std::min(a.block_size, n - first);
    const C* block = v_base + table[j] * a.block_size * a.kv_s0;
    int64_t o = 0;
    for (; o + 4 <= m; o += 4) {
      for (int64_t kh = 0, h = 0; kh < kh1 - kh0; ++kh) {
        const C* row = block + o * a.kv_s0 + kh * a.kv_s1;
        for (int64_t g = 0; g < group; ++g, ++h) {  // a group's later heads read V from L1
          const float* p = s + h * n + first + o;
          const __m256 p0 = _mm256_broadcast_ss(p), p1 = _mm256_broadcast_ss(p + 1);
          const __m256 p2 = _mm256_broadcast_ss(p + 2), p3 = _mm256_broadcast_ss(p + 3);
          float* ah = acc + h * d;
          for (int64_t i = 0; i < d; i += 8) {
            __m256 x = _mm256_fmadd_ps(p0, load8(row + i, a.v_scale), _mm256_loadu_ps(ah + i));
            x = _mm256_fmadd_ps(p1, load8(row + a.kv_s0 + i, a.v_scale), x);
            x = _mm256_fmadd_ps(p2, load8(row + 2 * a.kv_s0 + i, a.v_scale), x);
            _mm256_storeu_ps(ah + i, _mm256_fmadd_ps(p3, load8(row + 3 * a.kv_s0 + i, a.v_scale), x));
          }
        }
      }
    }
    for (; o < m; ++o) {
      for (int64_t kh = 0, h = 0; kh < kh1 - kh0; ++kh, h += group) {
        const C* row = block + o * a.kv_s0 + kh * a.kv_s1;
        for (int64_t i = 0; i < d; i += 8) {
          const __m256 vi = load8(row + i, a.v_scale);
          for (int64_t g = 0; g < group; ++g) {
            float* ah = acc + (h + g) * d + i;
            _mm256_storeu_ps(ah, _mm256_fmadd_ps(_mm256_broadcast_ss(s + (h + g) * n + first + o), vi, _mm256_loadu_ps(ah)));
          }
        }
      }
    }
  }
  store_out(a, b, h0, nh, acc);
}

bool avx2_path(int64_t d) {
  static const bool cpu = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return cpu && d % 8 == 0;
}
#endif

// Task i is row i / splits, kv heads [span * (i % splits), +span).
template <typename T, typename C>
SHOAL_INLINE void run(const Args<T, C>& a, int64_t splits, int64_t i, float* ws) {
  const int64_t span = a.kv_heads / splits, kh0 = (i % splits) * span;
  attend(a, i / splits, kh0, kh0 + span, ws);
}
// The one multiversioned function per dtype (everything it calls is inlined into each clone).
SHOAL_MULTIVERSION void run_f32(const Args<float, float>& a, int64_t sp, int64_t i, float* ws) { run(a, sp, i, ws); }
SHOAL_MULTIVERSION void run_bf16(const Args<c10::BFloat16, c10::BFloat16>& a, int64_t sp, int64_t i, float* ws) { run(a, sp, i, ws); }
SHOAL_MULTIVERSION void run_f16(const Args<c10::Half, c10::Half>& a, int64_t sp, int64_t i, float* ws) { run(a, sp, i, ws); }
SHOAL_MULTIVERSION void run_f32_fp8(const Args<float, Fp8>& a, int64_t sp, int64_t i, float* ws) { run(a, sp, i, ws); }
SHOAL_MULTIVERSION void run_bf16_fp8(const Args<c10::BFloat16, Fp8>& a, int64_t sp, int64_t i, float* ws) { run(a, sp, i, ws); }
SHOAL_MULTIVERSION void run_f16_fp8(const Args<c10::Half, Fp8>& a, int64_t sp, int64_t i, float* ws) { run(a, sp, i, ws); }

void run_portable(const Args<float, float>& a, int64_t sp, int64_t i, float* ws) { run_f32(a, sp, i, ws); }
void run_portable(const Args<c10::BFloat16, c10::BFloat16>& a, int64_t sp, int64_t i, float* ws) { run_bf16(a, sp, i, ws); }
void run_portable(const Args<c10::Half, c10::Half>& a, int64_t sp, int64_t i, float* ws) { run_f16(a, sp, i, ws); }
void run_portable(const Args<float, Fp8>& a, int64_t sp, int64_t i, float* ws) { run_f32_fp8(a, sp, i, ws); }
void run_portable(const Args<c10::BFloat16, Fp8>& a, int64_t sp, int64_t i, float* ws) { run_bf16_fp8(a, sp, i, ws); }
void run_portable(const Args<c10::Half, Fp8>& a, int64_t sp, int64_t i, float* ws) { run_f16_fp8(a, sp, i, ws); }

// The widest path a call may take: tests and SHOAL_CPU_ATTENTION hold a CPU to a narrower one.
enum Path : int64_t { kPortable = 0, kAvx2 = 1, kBest = 2 };

template <typename T, typename C>
void run_any(const Args<T, C>& a, int64_t splits, int64_t i, float* ws, int64_t widest) {
#ifdef SHOAL_HAS_VECTOR_PATHS
  const int64_t span = a.kv_heads / splits, kh0 = (i % splits) * span;
  if (widest >= kBest && avx512_path(a.d)) return avx512_task(a, i / splits, kh0, kh0 + span, ws);
  if (widest >= kAvx2 && avx2_path(a.d)) return avx2_task(a, i / splits, kh0, kh0 + span, ws);
#endif
  run_portable(a, splits, i, ws);
}

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

template <typename T, typename C>
void launch(Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
            const Tensor& tables, const Tensor& lens, int64_t block_size, double scale,
            int64_t window, double softcap, const float* sinks, int64_t max_len, int64_t widest,
            double k_scale, double v_scale) {
  Args<T, C> a{q.const_data_ptr<T>(), static_cast<const C*>(k_cache.const_data_ptr()),
            static_cast<const C*>(v_cache.const_data_ptr()),
            out.mutable_data_ptr<T>(), tables.const_data_ptr<int64_t>(), lens.const_data_ptr<int32_t>(),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
            tables.stride(0), q.size(1), k_cache.size(1), q.size(2), block_size,
            static_cast<float>(scale), window, static_cast<float>(softcap), sinks,
            static_cast<float>(k_scale), static_cast<float>(v_scale)};
  // Parallel over (batch row, kv heads): whole rows when there are enough rows to keep every
  // thread busy, else each row's kv heads are split into `splits` ranges (down to one each).
  const int64_t batch = q.size(0);
  const int64_t threads = std::max<int64_t>(1, torch::stable::get_num_threads());
  int64_t splits = 1;
  while (splits < a.kv_heads && batch * splits < 4 * threads) splits *= 2;
  while (a.kv_heads % splits) --splits;
  const int64_t tasks = batch * splits, nh = a.heads / splits;
  const int64_t ws_size = 2 * nh * a.d + a.d + nh * max_len + 16;  // + one 16-lane store's overhang
  // Tasks cost in proportion to their context length, which differs from row to row, so
  // instead of fixed shares each thread pulls tasks one at a time from a shared counter.
  // The workspace is allocated once per thread.
  const int64_t workers = std::min(threads, tasks);
  std::atomic<int64_t> next{0};
  torch::stable::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> ws(ws_size);
    for (int64_t i; (i = next.fetch_add(1)) < tasks;) run_any(a, splits, i, ws.data(), widest);
  });
}

}  // namespace

static void checked_launch(Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                    const Tensor& block_tables, const Tensor& context_lens, int64_t block_size,
                    double scale, int64_t window, double softcap, const std::optional<Tensor>& sinks,
                    int64_t widest, double k_scale, double v_scale) {
  // Shapes, dtypes, layouts and block ids are checked here, before any thread starts, so the
  // task loop can trust raw pointers.
  STD_TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3,
                  "q/out must be [B, heads, d] and the caches [num_slots, kv_heads, d]");
  for (int i = 0; i < 3; ++i) {
    STD_TORCH_CHECK(out.size(i) == q.size(i), "out and q differ in shape");
    STD_TORCH_CHECK(v_cache.size(i) == k_cache.size(i) && v_cache.stride(i) == k_cache.stride(i),
                    "k_cache and v_cache differ in shape or layout");
  }
  const int64_t batch = q.size(0), kv_heads = k_cache.size(1), d = q.size(2);
  STD_TORCH_CHECK(k_cache.size(2) == d, "head_dim of q and the cache differ");
  STD_TORCH_CHECK(kv_heads > 0 && q.size(1) % kv_heads == 0, "heads must be a multiple of kv_heads");
  // The caches hold q's dtype, or float8 e4m3 (an fp8 KV cache, read times k_scale / v_scale).
  const bool fp8 = k_cache.scalar_type() == ScalarType::Float8_e4m3fn;
  for (const Tensor* t : {static_cast<const Tensor*>(&out), &q, &k_cache, &v_cache}) {
    const bool is_cache = t == &k_cache || t == &v_cache;
    STD_TORCH_CHECK(t->is_cpu() && t->scalar_type() == (is_cache && fp8 ? ScalarType::Float8_e4m3fn : q.scalar_type()),
                    "q, out and the caches must be CPU tensors of one dtype (or float8_e4m3fn caches)");
    STD_TORCH_CHECK(t->stride(2) == 1, "the head_dim axis must be contiguous");
  }
  STD_TORCH_CHECK(fp8 || (k_scale == 1.0 && v_scale == 1.0), "k_scale / v_scale are for float8 caches only");
  STD_TORCH_CHECK(block_size > 0 && k_cache.size(0) % block_size == 0, "bad block_size");
  STD_TORCH_CHECK(block_tables.is_cpu() && block_tables.scalar_type() == ScalarType::Long &&
                      block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                      block_tables.size(0) == batch,
                  "block_tables must be a CPU int64 [B, nb] with contiguous rows");
  STD_TORCH_CHECK(context_lens.is_cpu() && context_lens.scalar_type() == ScalarType::Int &&
                      context_lens.dim() == 1 && context_lens.stride(0) == 1 && context_lens.size(0) == batch,
                  "context_lens must be a CPU int32 [B]");
  const float* sink_ptr = nullptr;
  if (sinks.has_value()) {
    STD_TORCH_CHECK(sinks->is_cpu() && sinks->scalar_type() == ScalarType::Float && sinks->dim() == 1 &&
                        sinks->size(0) == q.size(1) && sinks->stride(0) == 1,
                    "sinks must be a contiguous CPU float32 [heads]");
    sink_ptr = sinks->const_data_ptr<float>();
  }
  if (batch == 0) return;
  // Every block a row uses must exist: a bad id would read outside the pool.
  const int32_t* lens = context_lens.const_data_ptr<int32_t>();
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  const int64_t num_blocks = k_cache.size(0) / block_size, nb = block_tables.size(1);
  int64_t max_len = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t used = (std::max<int64_t>(lens[b], 0) + block_size - 1) / block_size;
    STD_TORCH_CHECK(used <= nb, "context length ", lens[b], " exceeds the block table of row ", b);
    for (int64_t j = 0; j < used; ++j) {
      const int64_t block = tables[b * block_tables.stride(0) + j];
      STD_TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " out of range [0, ",
                      num_blocks, ") in row ", b);
    }
    max_len = std::max<int64_t>(max_len, lens[b]);
  }

#define SHOAL_LAUNCH(T)                                                                              \
  return fp8 ? launch<T, Fp8>(out, q, k_cache, v_cache, block_tables, context_lens, block_size, scale, window, \
                              softcap, sink_ptr, max_len, widest, k_scale, v_scale)                        \
             : launch<T, T>(out, q, k_cache, v_cache, block_tables, context_lens, block_size, scale, window,   \
                            softcap, sink_ptr, max_len, widest, 1.0, 1.0)
  switch (q.scalar_type()) {
    case ScalarType::Float:
      SHOAL_LAUNCH(float);
    case ScalarType::BFloat16:
      SHOAL_LAUNCH(c10::BFloat16);
    case ScalarType::Half:
      SHOAL_LAUNCH(c10::Half);
    default:
      STD_TORCH_CHECK(false, "paged_decode_attention: unsupported dtype");
  }
}

void paged_decode_attention(Tensor out, Tensor q, Tensor k_cache, Tensor v_cache,
                            Tensor block_tables, Tensor context_lens, int64_t block_size,
                            double scale, int64_t window, double softcap, std::optional<Tensor> sinks,
                            double k_scale, double v_scale) {
  checked_launch(out, q, k_cache, v_cache, block_tables, context_lens, block_size, scale, window, softcap, sinks,
                 kBest, k_scale, v_scale);
}

// At most AVX2 + FMA even on an AVX-512 CPU (the AMD EPYCs' path), and the portable loop even
// where AVX-512 or AVX2 is there: for tests, benchmarks and SHOAL_CPU_ATTENTION.
void paged_decode_attention_avx2(Tensor out, Tensor q, Tensor k_cache, Tensor v_cache,
                                 Tensor block_tables, Tensor context_lens, int64_t block_size,
                                 double scale, int64_t window, double softcap, std::optional<Tensor> sinks,
                            double k_scale, double v_scale) {
  checked_launch(out, q, k_cache, v_cache, block_tables, context_lens, block_size, scale, window, softcap, sinks,
                 kAvx2, k_scale, v_scale);
}

void paged_decode_attention_portable(Tensor out, Tensor q, Tensor k_cache, Tensor v_cache,
                                     Tensor block_tables, Tensor context_lens, int64_t block_size,
                                     double scale, int64_t window, double softcap, std::optional<Tensor> sinks,
                            double k_scale, double v_scale) {
  checked_launch(out, q, k_cache, v_cache, block_tables, context_lens, block_size, scale, window, softcap, sinks,
                 kPortable, k_scale, v_scale);
}

STABLE_TORCH_LIBRARY(shoal, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor context_lens, int block_size, float scale, int window=0, "
        "float softcap=0., Tensor? sinks=None, float k_scale=1., float v_scale=1.) -> ()");
  m.def("paged_decode_attention_avx2(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor context_lens, int block_size, float scale, int window=0, "
        "float softcap=0., Tensor? sinks=None, float k_scale=1., float v_scale=1.) -> ()");
  m.def("paged_decode_attention_portable(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor context_lens, int block_size, float scale, int window=0, "
        "float softcap=0., Tensor? sinks=None, float k_scale=1., float v_scale=1.) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(shoal, CPU, m) {
  m.impl("paged_decode_attention", TORCH_BOX(&paged_decode_attention));
  m.impl("paged_decode_attention_avx2", TORCH_BOX(&paged_decode_attention_avx2));
  m.impl("paged_decode_attention_portable", TORCH_BOX(&paged_decode_attention_portable));
}
