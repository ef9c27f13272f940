// Paged decode attention on CPU: every decode row reads its keys and values straight from
// the paged KV pool (no gather copy); parallel over (batch row, range of kv heads).
//
//   out[b, h] = softmax(scale * q[b, h] . K[b, :n_b]) @ V[b, :n_b],   h in the kv head's group
//   K[b, t] = k_cache[block_tables[b, t / block_size] * block_size + t % block_size, h / group]
//
// float32 / bfloat16 / float16 caches; all arithmetic is float32. No -ffast-math: the result
// stays within ~1e-6 of torch's scaled_dot_product_attention.
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
#include <limits>
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

template <typename T>
struct Args {
  const T* q;
  const T* k;
  const T* v;
  T* out;
  const int64_t* tables;
  const int32_t* lens;
  int64_t q_s0, q_s1, o_s0, o_s1, kv_s0, kv_s1, table_s0;  // strides, in elements
  int64_t heads, kv_heads, d, block_size;
  float scale;
};

// A K/V row as float32: fp32 rows are used in place, 16-bit rows are widened into `buf`.
SHOAL_INLINE const float* as_float(const float* src, float*, int64_t) { return src; }

SHOAL_INLINE const float* as_float(const c10::BFloat16* src, float* buf, int64_t d) {
  // bfloat16 is the top half of a float32: a shift, which vectorises.
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < d; ++i) {
    uint32_t bits = uint32_t(s[i]) << 16;
    std::memcpy(buf + i, &bits, sizeof(float));
  }
  return buf;
}

SHOAL_INLINE const float* as_float(const c10::Half* src, float* buf, int64_t d) {
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

template <typename T, typename F>
SHOAL_INLINE void for_each_slot(const Args<T>& a, const int64_t* table, int64_t n,
                                const T* base, int64_t row_bytes, F fn) {
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

// One task: batch row b, kv heads [kh0, kh1) and the query heads they serve. Going through
// the tokens once for all those heads reads each token's K (then V) as one contiguous run
// (~1.4x faster than one kv head per task), and each K/V row serves its whole GQA group.
// Two passes: scores into the workspace, a max-subtracted softmax, then the sum of V rows.
template <typename T>
SHOAL_INLINE void attend(const Args<T>& a, int64_t b, int64_t kh0, int64_t kh1, float* ws) {
  const int64_t d = a.d, group = a.heads / a.kv_heads, n = a.lens[b];
  const int64_t h0 = kh0 * group, nh = (kh1 - kh0) * group;  // query heads of this task
  float* qf = ws;             // [nh, d] queries in float32
  float* acc = qf + nh * d;   // [nh, d] output accumulators
  float* row = acc + nh * d;  // [d] one widened K/V row
  float* s = row + d;         // [nh, n] scores, then probabilities
  const int64_t* table = a.tables + b * a.table_s0;
  const int64_t row_bytes = (kh1 - kh0) * a.kv_s1 * int64_t(sizeof(T));
  T* out = a.out + b * a.o_s0;

  if (n <= 0) {  // nothing to attend to (the engine never sends this): zeros, not NaN
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t i = 0; i < d; ++i) out[(h0 + h) * a.o_s1 + i] = T(0.0f);
    return;
  }
  for (int64_t h = 0; h < nh; ++h) {
    const float* src = as_float(a.q + b * a.q_s0 + (h0 + h) * a.q_s1, row, d);
    std::memcpy(qf + h * d, src, d * sizeof(float));
  }

  // Pass 1: scaled scores q . k for every key; kv head kh serves query heads [kh*group, +group).
  for_each_slot(a, table, n, a.k + kh0 * a.kv_s1, row_bytes, [&](int64_t t, int64_t slot) {
    for (int64_t kh = kh0, h = 0; kh < kh1; ++kh) {
      const float* k = as_float(a.k + slot * a.kv_s0 + kh * a.kv_s1, row, d);
      for (int64_t g = 0; g < group; ++g, ++h) s[h * n + t] = dot(qf + h * d, k, d) * a.scale;
    }
  });

  // Softmax per query head, numerically stable: exp(x - max) <= 1.
  for (int64_t h = 0; h < nh; ++h) {
    float* sh = s + h * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sh[t]);
    float sum = 0.0f;
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
      const float* v = as_float(a.v + slot * a.kv_s0 + kh * a.kv_s1, row, d);
      for (int64_t g = 0; g < group; ++g, ++h) {
        const float p = s[h * n + t];
        float* ah = acc + h * d;
        for (int64_t i = 0; i < d; ++i) ah[i] += p * v[i];
      }
    }
  });
  for (int64_t h = 0; h < nh; ++h)
    for (int64_t i = 0; i < d; ++i) out[(h0 + h) * a.o_s1 + i] = T(acc[h * d + i]);
}

// Task i is row i / splits, kv heads [span * (i % splits), +span).
template <typename T>
SHOAL_INLINE void run(const Args<T>& a, int64_t splits, int64_t i, float* ws) {
  const int64_t span = a.kv_heads / splits, kh0 = (i % splits) * span;
  attend(a, i / splits, kh0, kh0 + span, ws);
}
// The one multiversioned function per dtype (everything it calls is inlined into each clone).
SHOAL_MULTIVERSION void run_f32(const Args<float>& a, int64_t sp, int64_t i, float* ws) { run(a, sp, i, ws); }
SHOAL_MULTIVERSION void run_bf16(const Args<c10::BFloat16>& a, int64_t sp, int64_t i, float* ws) { run(a, sp, i, ws); }
SHOAL_MULTIVERSION void run_f16(const Args<c10::Half>& a, int64_t sp, int64_t i, float* ws) { run(a, sp, i, ws); }

void run_any(const Args<float>& a, int64_t sp, int64_t i, float* ws) { run_f32(a, sp, i, ws); }
void run_any(const Args<c10::BFloat16>& a, int64_t sp, int64_t i, float* ws) { run_bf16(a, sp, i, ws); }
void run_any(const Args<c10::Half>& a, int64_t sp, int64_t i, float* ws) { run_f16(a, sp, i, ws); }

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

template <typename T>
void launch(Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
            const Tensor& tables, const Tensor& lens, int64_t block_size, double scale,
            int64_t max_len) {
  Args<T> a{q.const_data_ptr<T>(), k_cache.const_data_ptr<T>(), v_cache.const_data_ptr<T>(),
            out.mutable_data_ptr<T>(), tables.const_data_ptr<int64_t>(), lens.const_data_ptr<int32_t>(),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
            tables.stride(0), q.size(1), k_cache.size(1), q.size(2), block_size,
            static_cast<float>(scale)};
  // Parallel over (batch row, kv heads): whole rows when there are enough rows to keep every
  // thread busy, else each row's kv heads are split into `splits` ranges (down to one each).
  const int64_t batch = q.size(0);
  const int64_t threads = std::max<int64_t>(1, torch::stable::get_num_threads());
  int64_t splits = 1;
  while (splits < a.kv_heads && batch * splits < 4 * threads) splits *= 2;
  while (a.kv_heads % splits) --splits;
  const int64_t tasks = batch * splits, nh = a.heads / splits;
  const int64_t ws_size = 2 * nh * a.d + a.d + nh * max_len;
  // Tasks cost in proportion to their context length, which differs from row to row, so
  // instead of fixed shares each thread pulls tasks one at a time from a shared counter.
  // The workspace is allocated once per thread.
  const int64_t workers = std::min(threads, tasks);
  std::atomic<int64_t> next{0};
  torch::stable::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> ws(ws_size);
    for (int64_t i; (i = next.fetch_add(1)) < tasks;) run_any(a, splits, i, ws.data());
  });
}

}  // namespace

void paged_decode_attention(Tensor out, Tensor q, Tensor k_cache, Tensor v_cache,
                            Tensor block_tables, Tensor context_lens, int64_t block_size,
                            double scale) {
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
  for (const Tensor* t : {&out, &q, &k_cache, &v_cache}) {
    STD_TORCH_CHECK(t->is_cpu() && t->scalar_type() == q.scalar_type(),
                    "q, out and the caches must be CPU tensors of one dtype");
    STD_TORCH_CHECK(t->stride(2) == 1, "the head_dim axis must be contiguous");
  }
  STD_TORCH_CHECK(block_size > 0 && k_cache.size(0) % block_size == 0, "bad block_size");
  STD_TORCH_CHECK(block_tables.is_cpu() && block_tables.scalar_type() == ScalarType::Long &&
                      block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                      block_tables.size(0) == batch,
                  "block_tables must be a CPU int64 [B, nb] with contiguous rows");
  STD_TORCH_CHECK(context_lens.is_cpu() && context_lens.scalar_type() == ScalarType::Int &&
                      context_lens.dim() == 1 && context_lens.stride(0) == 1 && context_lens.size(0) == batch,
                  "context_lens must be a CPU int32 [B]");
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

  switch (q.scalar_type()) {
    case ScalarType::Float:
      return launch<float>(out, q, k_cache, v_cache, block_tables, context_lens, block_size, scale, max_len);
    case ScalarType::BFloat16:
      return launch<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, context_lens, block_size, scale, max_len);
    case ScalarType::Half:
      return launch<c10::Half>(out, q, k_cache, v_cache, block_tables, context_lens, block_size, scale, max_len);
    default:
      STD_TORCH_CHECK(false, "paged_decode_attention: unsupported dtype");
  }
}

STABLE_TORCH_LIBRARY(shoal, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor context_lens, int block_size, float scale) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(shoal, CPU, m) {
  m.impl("paged_decode_attention", TORCH_BOX(&paged_decode_attention));
}
