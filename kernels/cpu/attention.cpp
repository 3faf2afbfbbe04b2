// Decode attention over the paged KV cache on x86-64 CPUs (fp32 or bf16; AVX2 + FMA or AVX-512): one query token
// per sequence attends to its context (or, with a sliding window, its last `window` tokens), read in place through
// the block table. Optional tanh soft-capping of the scores (Gemma 2: s = cap * tanh(s / cap), before the softmax).
//
// Why: the torch path gathers every sequence's K and V blocks into padded copies before attending
// (shared/attention.py), which at batch 8-32 writes and rereads megabytes per layer; here each K and V row is
// read once, where it lies. Softmax is exact two-pass fp32 (scores, max, e^(s - max), sum), as the reference
// kernels/paged_attention.py paged_decode_attention_ref computes it; e^x is Cephes' polynomial (simd.h). A bf16
// query and cache are widened to fp32 as they are loaded (exact); scores, softmax and the weighted sum of V are
// fp32, and the output is rounded to bf16 once (as the reference: fp32 math, then .to(bf16)).
//
// Layouts (those of shared/attention.py): query [S, Hq, D]; key_cache, value_cache [num_blocks, block_size, Hkv, D]
// (the query's dtype); block_tables int32 [S, max_blocks]; context_lens int32 [S]; Hq % Hkv == 0 (the query heads
// of KV head h are h * Hq / Hkv ... (h + 1) * Hq / Hkv - 1, as in HF's repeat_kv); D % LANES == 0.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "simd.h"
#include "thread_pool.h"

namespace {
using namespace tandem_simd;

constexpr int MAX_DV = 256 / LANES;  // head_dim up to 256

// out [group, D] = softmax(q k^T * scale) v for the query rows q [group, D] of one sequence and KV head h, over its
// tokens first..ctx-1 (blocks before first's are never read). T: float or at::BFloat16.
template <typename T>
void attend_one(const T* q, int64_t group, const T* key_cache, const T* value_cache, const int32_t* block_table,
                int64_t first, int64_t ctx, int64_t block_size, int64_t num_kv_heads, int64_t h, int64_t D,
                float scale, float softcap, T* out, std::vector<float>& scores) {
  const int64_t dv = D / LANES;
  const int64_t n = ctx - first;
  const int64_t padded = (n + LANES - 1) / LANES * LANES;
  scores.resize(group * padded);
  auto row = [&](const T* cache, int64_t i) {
    const int64_t t = first + i;
    const int64_t slot = static_cast<int64_t>(block_table[t / block_size]) * block_size + t % block_size;
    return cache + (slot * num_kv_heads + h) * D;
  };
  for (int64_t r = 0; r < group; ++r) {
    V qv[MAX_DV];
    for (int64_t d = 0; d < dv; ++d) qv[d] = load_f32(q + r * D + d * LANES);
    float* s = scores.data() + r * padded;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) {
      const T* k = row(key_cache, t);
      V acc = vmul(qv[0], load_f32(k));
      for (int64_t d = 1; d < dv; ++d) acc = vfmadd(qv[d], load_f32(k + d * LANES), acc);
      s[t] = hsum(acc) * scale;
      if (softcap > 0.0f) s[t] = softcap * std::tanh(s[t] / softcap);
      m = std::max(m, s[t]);
    }
    std::fill(s + n, s + padded, m);  // (their e^0 are computed but never summed or used)
    const V mv = vbroadcast_value(m);
    for (int64_t t = 0; t < padded; t += LANES) store(s + t, vexp(vsub(vload(s + t), mv)));
    float sum = 0.0f;
    for (int64_t t = 0; t < n; ++t) sum += s[t];
    const float inv = 1.0f / sum;
    V acc[MAX_DV];
    for (int64_t d = 0; d < dv; ++d) acc[d] = vzero();
    for (int64_t t = 0; t < n; ++t) {
      const T* v = row(value_cache, t);
      const V p = vbroadcast_value(s[t]);
      for (int64_t d = 0; d < dv; ++d) acc[d] = vfmadd(p, load_f32(v + d * LANES), acc[d]);
    }
    const V iv = vbroadcast_value(inv);
    for (int64_t d = 0; d < dv; ++d) store_f32(out + r * D + d * LANES, vmul(acc[d], iv));
  }
}

}  // namespace

// query [S, Hq, D]; key_cache, value_cache [num_blocks, block_size, Hkv, D] (all fp32 or all bf16); block_tables
// int32 [S, max_blocks]; context_lens int32 [S]; window: attend to the last `window` tokens only (0: all); softcap:
// cap the scores (0: none) -> out [S, Hq, D] of the query's dtype (zeros for a context of 0 tokens). Block-table
// entries before the window are never read (nor checked).
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t window, double softcap) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "query must be [S, Hq, D] and the caches [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(query.scalar_type() == torch::kFloat || query.scalar_type() == torch::kBFloat16,
              "query must be fp32 or bf16");
  for (const auto* t : {&query, &key_cache, &value_cache})
    TORCH_CHECK(t->scalar_type() == query.scalar_type() && t->is_contiguous(),
                "query and caches must be contiguous and of one dtype (fp32 or bf16)");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt && context_lens.scalar_type() == torch::kInt &&
                  block_tables.is_contiguous() && context_lens.is_contiguous(),
              "block_tables and context_lens must be contiguous int32");
  const int64_t S = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t block_size = key_cache.size(1), Hkv = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D && D % LANES == 0 && D <= MAX_DV * LANES, "head_dim must match, be a multiple "
              "of the SIMD width and at most 256");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads must be a positive multiple of KV heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == S && context_lens.numel() == S,
              "block_tables [S, max_blocks] and context_lens [S] must match query");
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must be >= 0 (0: none)");
  const int32_t* ctx_lens = context_lens.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t num_blocks = key_cache.size(0);
  for (int64_t i = 0; i < S; ++i) {
    TORCH_CHECK(ctx_lens[i] >= 0 && (ctx_lens[i] + block_size - 1) / block_size <= max_blocks,
                "context_lens exceed the block table");
    const int64_t first = window > 0 ? std::max<int64_t>(0, ctx_lens[i] - window) : 0;
    for (int64_t b = first / block_size; b < (ctx_lens[i] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(bt[i * max_blocks + b] >= 0 && bt[i * max_blocks + b] < num_blocks,
                  "block_tables hold a block id outside the cache");
  }
  auto out = torch::zeros_like(query);
  const int64_t group = Hq / Hkv;
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const T* qp = query.data_ptr<T>();
    const T* kp = key_cache.data_ptr<T>();
    const T* vp = value_cache.data_ptr<T>();
    T* op = out.data_ptr<T>();
    tandem_pool::parallel_for(S * Hkv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t s = i / Hkv, h = i % Hkv;
        if (ctx_lens[s] == 0) continue;
        const int64_t offset = (s * Hq + h * group) * D;
        const int64_t first = window > 0 ? std::max<int64_t>(0, ctx_lens[s] - window) : 0;
        attend_one(qp + offset, group, kp, vp, bt + s * max_blocks, first, ctx_lens[s], block_size, Hkv, h, D,
                   static_cast<float>(scale), static_cast<float>(softcap), op + offset, scores);
      }
    });
  };
  if (query.scalar_type() == torch::kFloat) run(float{});
  else run(at::BFloat16{});
  return out;
}
