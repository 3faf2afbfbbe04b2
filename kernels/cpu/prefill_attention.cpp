// Causal attention of a flat batch of query chunks over the paged KV cache on x86-64 CPUs (prefill, chunked
// prefill after a cached prefix, mixed batches): fp32 or bf16, GQA, optional sliding window and tanh soft-capping.
//
// Why: the torch path (shared/attention.py _per_request_cpu) gathers each request's blocks into a copy and runs
// scaled_dot_product_attention on torch's one thread, about half of a 512-token prefill chunk's time on the default
// model (docs/performance.md). Here the work runs on the kernels' threads, K and V are read through the block
// table a tile at a time (no copy of the whole context), and each tile serves every query row of its KV head's
// group.
//
// Method: FlashAttention-2 (Dao 2023) on the CPU. A task is one sequence, one KV head and a block of query
// positions; its rows are those positions x the group's query heads (GQA: the heads of KV head h are
// h * Hq / Hkv ... (h + 1) * Hq / Hkv - 1, as HF's repeat_kv). For each tile of BK keys (from the task's first
// visible key to its last row's position) the keys and values are gathered into fp32 [BK, D]; register-blocked
// micro-tiles compute the scores (RK keys x NV vectors of query rows: a broadcast key element times a vector of the
// transposed queries per FMA, so the scores come out transposed, [keys, rows]) and the weighted sum of V (RK rows
// x NV vectors of D); an online softmax (running max m and sum l per row, the
// output rescaled by e^(m_old - m_new)) joins the tiles, vectorized across query rows (no horizontal reductions).
// All math is fp32 (bf16 widened as it is loaded, exact); the output is rounded once to the query's dtype. e^x:
// simd.h's vexp. Tasks are claimed heaviest first (tandem_pool's shared counter).
//
// Masking (kernels/masks.py causal_mask): query row j of a sequence with n query rows and a context of ctx tokens
// sits at position ctx - n + j and sees key k when k <= that position and, with a window, position - k < window.
//
// Layouts (those of shared/attention.py): query [T, Hq, D]; key_cache, value_cache [num_blocks, block_size, Hkv, D]
// (the query's dtype); block_tables int32 [S, max_blocks]; query_start_loc int32 [S + 1]; context_lens int32 [S];
// D % LANES == 0.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "simd.h"
#include "thread_pool.h"

namespace {
using namespace tandem_simd;

constexpr int64_t BK = 64;                // keys per tile
constexpr int NV = LANES == 16 ? 4 : 2;   // vectors per micro-tile (of query rows, or of D): 64 or 16 floats
constexpr int RK = LANES == 16 ? 6 : 4;   // keys (scores) or query rows (outputs) per micro-tile: RK x NV
                                          // accumulators, 24 of 32 zmm or 8 of 16 ymm registers
constexpr int64_t ROWS_PER_TASK = 128;    // about this many query rows (positions x group heads) per task
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// Lane masks: a <= b, a == b, and m ? a : b.
#ifdef __AVX512F__
using M = __mmask16;
inline M vle(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
inline M veq(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline M mand(M a, M b) { return a & b; }
inline V vselect(M m, V a, V b) { return _mm512_mask_blend_ps(m, b, a); }
#else
using M = __m256;
inline M vle(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_LE_OQ); }
inline M veq(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
inline M mand(M a, M b) { return _mm256_and_ps(a, b); }
inline V vselect(M m, V a, V b) { return _mm256_blendv_ps(b, a, m); }
#endif

// st[k][0 .. NVV * LANES) = k_rows[k] . qt[:, 0 .. NVV * LANES) for R keys: k_rows [R, D] (stride D), qt [D, rp]
// (the task's queries transposed, stride rp), st [R, rp] (stride rp): a broadcast key element times a vector of
// query rows per FMA.
template <int R, int NVV>
inline void qk_tile(const float* k_rows, int64_t D, const float* qt, int64_t rp, float* st) {
  V acc[R][NVV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NVV; ++j) acc[i][j] = vzero();
  for (int64_t d = 0; d < D; ++d) {
    V q[NVV];
    for (int j = 0; j < NVV; ++j) q[j] = vload(qt + d * rp + j * LANES);
    for (int i = 0; i < R; ++i) {
      const V kv = vbroadcast(k_rows + i * D + d);
      for (int j = 0; j < NVV; ++j) acc[i][j] = vfmadd(kv, q[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NVV; ++j) store(st + i * rp + j * LANES, acc[i][j]);
}

// o[i][0 .. NVV * LANES) += sum over k < nk of pt[k][i] * v[k][0 .. NVV * LANES) for R query rows: pt [nk, rp]
// (stride rp), v [nk, D] and o [R, D] (stride D).
template <int R, int NVV>
inline void pv_tile(const float* pt, int64_t rp, const float* v, int64_t D, int64_t nk, float* o) {
  V acc[R][NVV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NVV; ++j) acc[i][j] = vload(o + i * D + j * LANES);
  for (int64_t k = 0; k < nk; ++k) {
    V vv[NVV];
    for (int j = 0; j < NVV; ++j) vv[j] = vload(v + k * D + j * LANES);
    for (int i = 0; i < R; ++i) {
      const V p = vbroadcast(pt + k * rp + i);
      for (int j = 0; j < NVV; ++j) acc[i][j] = vfmadd(p, vv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NVV; ++j) store(o + i * D + j * LANES, acc[i][j]);
}

// The micro-tiles with R (1 .. RK) and NVV (1 .. NV) known only at run time (a tile's last keys or rows, the last
// vectors of rows or of D).
template <typename Fn>
void with_nvv(int nvv, Fn&& fn) {
  static_assert(NV == 4 || NV == 2);
  switch (nvv) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: if constexpr (NV == 4) fn(std::integral_constant<int, 3>{}); break;
    default: if constexpr (NV == 4) fn(std::integral_constant<int, 4>{});
  }
}

template <int R = RK>
void qk_any(int r, int nvv, const float* k_rows, int64_t D, const float* qt, int64_t rp, float* st) {
  if constexpr (R > 1) {
    if (r < R) return qk_any<R - 1>(r, nvv, k_rows, D, qt, rp, st);
  }
  with_nvv(nvv, [&](auto n) { qk_tile<R, decltype(n)::value>(k_rows, D, qt, rp, st); });
}

template <int R = RK>
void pv_any(int r, int nvv, const float* pt, int64_t rp, const float* v, int64_t D, int64_t nk, float* o) {
  if constexpr (R > 1) {
    if (r < R) return pv_any<R - 1>(r, nvv, pt, rp, v, D, nk, o);
  }
  with_nvv(nvv, [&](auto n) { pv_tile<R, decltype(n)::value>(pt, rp, v, D, nk, o); });
}

struct Task {
  int64_t seq, head, row_begin, row_end;  // query rows row_begin .. row_end - 1 of the sequence (chunk-local)
  int64_t cost;                           // keys x rows, to claim the heaviest first
};

// One task: its rows are (position ctx - n + i for i in [task.row_begin, task.row_end)) x (the group's heads),
// row r = (r / group, r % group), padded to rp rows (a multiple of LANES) whose keys are all masked.
template <typename T>
void attend_task(const Task& task, const T* query, const T* key_cache, const T* value_cache, const int32_t* table,
                 int64_t q_start, int64_t n, int64_t ctx, int64_t block_size, int64_t Hq, int64_t Hkv, int64_t D,
                 float scale, int64_t window, float softcap, T* out) {
  const int64_t group = Hq / Hkv, h = task.head;
  const int64_t positions = task.row_end - task.row_begin, rows = positions * group;
  const int64_t rp = (rows + LANES - 1) / LANES * LANES;
  const int64_t first_pos = ctx - n + task.row_begin, last_pos = ctx - n + task.row_end - 1;
  // fp32 buffers: queries transposed [D, rp], keys and values [BK, D], scores then probabilities transposed
  // [BK, rp], outputs [rows, D]; per row: position, first visible key, running max, running sum, rescale factor
  std::vector<float> buffer(D * rp + 2 * BK * D + BK * rp + rows * D + 5 * rp);
  float* qt = buffer.data();
  float* kbuf = qt + D * rp;
  float* vbuf = kbuf + BK * D;
  float* st = vbuf + BK * D;
  float* o = st + BK * rp;
  float* pos = o + rows * D;
  float* lo = pos + rp;
  float* m = lo + rp;
  float* l = m + rp;
  float* alpha = l + rp;
  std::fill(qt, qt + D * rp, 0.0f);
  std::fill(o, o + rows * D, 0.0f);
  for (int64_t r = 0; r < rp; ++r) {
    const int64_t p = first_pos + r / group;
    // NOTE: positions as fp32 (compared with key indices in fp32 lanes) are exact below 2^24 tokens
    pos[r] = r < rows ? static_cast<float>(p) : -1.0f;  // (padding rows see no key)
    lo[r] = window > 0 ? static_cast<float>(p - window + 1) : 0.0f;
    m[r] = NEG_INF;
    l[r] = 0.0f;
  }
  // the group's heads of one position are contiguous in query: rows i * group .. i * group + group - 1
  for (int64_t i = 0; i < positions; ++i) {
    const T* src = query + ((q_start + task.row_begin + i) * Hq + h * group) * D;
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < D; ++d) qt[d * rp + i * group + g] = to_f32(src[g * D + d]);
  }
  auto slot_row = [&](const T* cache, int64_t t) {
    const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
    return cache + (slot * Hkv + h) * D;
  };
  const V sv = vbroadcast_value(scale), neg_inf = vbroadcast_value(NEG_INF), zero = vzero();
  const int row_vectors = static_cast<int>(rp / LANES);
  for (int64_t kb = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0; kb <= last_pos; kb += BK) {
    const int64_t nk = std::min(BK, last_pos + 1 - kb);
    for (int64_t k = 0; k < nk; ++k) {
      const T* kr = slot_row(key_cache, kb + k);
      const T* vr = slot_row(value_cache, kb + k);
      for (int64_t d = 0; d < D; d += LANES) {
        store(kbuf + k * D + d, load_f32(kr + d));
        store(vbuf + k * D + d, load_f32(vr + d));
      }
    }
    for (int64_t k = 0; k < nk; k += RK)
      for (int c = 0; c < row_vectors; c += NV)
        qk_any(static_cast<int>(std::min<int64_t>(RK, nk - k)), std::min(NV, row_vectors - c), kbuf + k * D, D,
               qt + c * LANES, rp, st + k * rp + c * LANES);
    // online softmax, LANES rows at a time down the tile's keys; probabilities replace the scores (0 where masked)
    for (int64_t r = 0; r < rp; r += LANES) {
      const V pv = vload(pos + r), lov = vload(lo + r), m_old = vload(m + r);
      V mx = m_old;
      for (int64_t k = 0; k < nk; ++k) {
        const V key = vbroadcast_value(static_cast<float>(kb + k));
        V x = vmul(vload(st + k * rp + r), sv);
        if (softcap > 0.0f) {
          alignas(64) float lanes[LANES];
          store(lanes, x);
          for (float& e : lanes) e = softcap * std::tanh(e / softcap);
          x = vload(lanes);
        }
        x = vselect(mand(vle(key, pv), vle(lov, key)), x, neg_inf);
        store(st + k * rp + r, x);
        mx = vmax(mx, x);
      }
      const V m_safe = vselect(veq(mx, neg_inf), zero, mx);  // (rows with no visible key yet: p = 0, alpha = 1)
      V sum = vzero();
      for (int64_t k = 0; k < nk; ++k) {
        const V x = vload(st + k * rp + r);
        const V p = vselect(veq(x, neg_inf), zero, vexp(vsub(x, m_safe)));  // (vexp(-inf) would be e^-87)
        store(st + k * rp + r, p);
        sum = vadd(sum, p);
      }
      const V a = vselect(veq(m_old, neg_inf), zero, vexp(vsub(m_old, m_safe)));
      store(l + r, vadd(vmul(vload(l + r), a), sum));
      store(m + r, mx);
      store(alpha + r, a);
    }
    for (int64_t r = 0; r < rows; ++r) {
      if (alpha[r] == 1.0f) continue;
      const V av = vbroadcast_value(alpha[r]);
      for (int64_t d = 0; d < D; d += LANES) store(o + r * D + d, vmul(vload(o + r * D + d), av));
    }
    for (int64_t r = 0; r < rows; r += RK)
      for (int64_t d = 0; d < D; d += NV * LANES)
        pv_any(static_cast<int>(std::min<int64_t>(RK, rows - r)),
               static_cast<int>(std::min<int64_t>(NV, (D - d) / LANES)), st + r, rp, vbuf + d, D, nk, o + r * D + d);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / group, g = r % group;
    T* dst = out + ((q_start + task.row_begin + i) * Hq + h * group + g) * D;
    const V inv = vbroadcast_value(l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
    for (int64_t d = 0; d < D; d += LANES) store_f32(dst + d, vmul(vload(o + r * D + d), inv));
  }
}

}  // namespace

// query [T, Hq, D]; key_cache, value_cache [num_blocks, block_size, Hkv, D] (all fp32 or all bf16, already holding
// this step's keys and values); block_tables int32 [S, max_blocks]; query_start_loc int32 [S + 1] (sequence s owns
// query rows query_start_loc[s] .. query_start_loc[s + 1] - 1, the last positions of its context_lens[s] tokens);
// context_lens int32 [S]; window: attend to the last `window` positions only (0: all); softcap: cap the scores (0:
// none) -> out [T, Hq, D] of the query's dtype. Block-table entries before a sequence's first visible key are
// never read (nor checked).
torch::Tensor paged_prefill_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                      torch::Tensor block_tables, torch::Tensor query_start_loc,
                                      torch::Tensor context_lens, double scale, int64_t window, double softcap) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "query must be [T, Hq, D] and the caches [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(query.scalar_type() == torch::kFloat || query.scalar_type() == torch::kBFloat16,
              "query must be fp32 or bf16");
  for (const auto* t : {&query, &key_cache, &value_cache})
    TORCH_CHECK(t->scalar_type() == query.scalar_type() && t->is_contiguous(),
                "query and caches must be contiguous and of one dtype (fp32 or bf16)");
  for (const auto* t : {&block_tables, &query_start_loc, &context_lens})
    TORCH_CHECK(t->scalar_type() == torch::kInt && t->is_contiguous(),
                "block_tables, query_start_loc and context_lens must be contiguous int32");
  const int64_t Hq = query.size(1), D = query.size(2);
  const int64_t block_size = key_cache.size(1), Hkv = key_cache.size(2), num_blocks = key_cache.size(0);
  TORCH_CHECK(key_cache.size(3) == D && D % LANES == 0 && D > 0,
              "head_dim must match the caches' and be a multiple of the SIMD width");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads must be a positive multiple of KV heads");
  const int64_t S = context_lens.numel(), max_blocks = block_tables.size(1);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == S && query_start_loc.numel() == S + 1,
              "block_tables [S, max_blocks], query_start_loc [S + 1] and context_lens [S] must agree");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* ctx_lens = context_lens.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  TORCH_CHECK(qsl[0] == 0 && qsl[S] == query.size(0), "query_start_loc must run from 0 to the query's rows");
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must be >= 0 (0: none)");
  const int64_t group = Hq / Hkv;
  const int64_t positions_per_task = std::max<int64_t>(1, ROWS_PER_TASK / group);
  std::vector<Task> tasks;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = qsl[s + 1] - qsl[s], ctx = ctx_lens[s];
    TORCH_CHECK(n >= 0 && n <= ctx, "sequence ", s, ": ", n, " query rows but a context of ", ctx, " tokens");
    TORCH_CHECK((ctx + block_size - 1) / block_size <= max_blocks, "context_lens exceed the block table");
    if (n == 0) continue;
    const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - n - window + 1) : 0;
    for (int64_t b = first / block_size; b < (ctx + block_size - 1) / block_size; ++b)
      TORCH_CHECK(bt[s * max_blocks + b] >= 0 && bt[s * max_blocks + b] < num_blocks,
                  "block_tables hold a block id outside the cache");
    for (int64_t i = 0; i < n; i += positions_per_task) {
      const int64_t end = std::min(n, i + positions_per_task);
      const int64_t last = ctx - n + end - 1;
      const int64_t keys = last + 1 - (window > 0 ? std::max<int64_t>(0, ctx - n + i - window + 1) : 0);
      for (int64_t h = 0; h < Hkv; ++h) tasks.push_back({s, h, i, end, keys * (end - i)});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  auto out = torch::empty_like(query);
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const T* qp = query.data_ptr<T>();
    const T* kp = key_cache.data_ptr<T>();
    const T* vp = value_cache.data_ptr<T>();
    T* op = out.data_ptr<T>();
    tandem_pool::parallel_for(static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const Task& task = tasks[t];
        const int64_t s = task.seq;
        attend_task<T>(task, qp, kp, vp, bt + s * max_blocks, qsl[s], qsl[s + 1] - qsl[s], ctx_lens[s], block_size,
                       Hq, Hkv, D, static_cast<float>(scale), window, static_cast<float>(softcap), op);
      }
    });
  };
  if (query.scalar_type() == torch::kFloat) run(float{});
  else run(at::BFloat16{});
  return out;
}
