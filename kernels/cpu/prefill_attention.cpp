// Causal attention of a flat batch of query chunks over the paged KV cache on x86-64 CPUs (prefill, chunked
// prefill after a cached prefix, mixed batches): fp32 or bf16, GQA, optional sliding window and tanh soft-capping.
//
// Why: the torch path (shared/attention.py _per_request_cpu) gathers each request's blocks into a copy and runs
// scaled_dot_product_attention on torch's one thread, about half of a 512-token prefill chunk's time on the default
// model (docs/performance.md). Here the work runs on the kernels' threads, K and V are read in place through the
// block table, and each K/V tile is read once for every query row of its KV head's group.
//
// Method: FlashAttention-2 (Dao 2023) on the CPU. A task is one sequence, one KV head and a block of query
// positions; its rows are those positions x the group's query heads (GQA: the heads of KV head h are
// h * Hq / Hkv ... (h + 1) * Hq / Hkv - 1, as HF's repeat_kv). For each tile of BK keys (from the task's first
// visible key to its last row's position) the keys are gathered transposed into fp32 [D, BK] and the values into
// fp32 [BK, D]; register-blocked micro-tiles compute the scores (RR rows x NV vectors of keys, a broadcast query
// element times a row of keys per FMA) and the weighted sum of V (RR rows x NV vectors of D); an online softmax
// (running max m and sum l per row, the output rescaled by e^(m_old - m_new)) joins the tiles. All math is fp32
// (bf16 widened as it is loaded, exact); the output is rounded once to the query's dtype. e^x: simd.h's vexp for
// the scores, std::exp for the rescale factors. Tasks are claimed heaviest first (tandem_pool's shared counter).
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

constexpr int64_t BK = 64;                 // keys per tile
constexpr int NV = LANES == 16 ? 4 : 2;    // vectors per micro-tile row (keys or D): 64 or 16 floats
constexpr int RR = LANES == 16 ? 6 : 4;    // rows per micro-tile (RR x NV accumulators: 24 of 32 zmm, 8 of 16 ymm)
constexpr int64_t ROWS_PER_TASK = 128;     // about this many rows (positions x group heads) per task
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
static_assert(BK % (NV * LANES) == 0, "a key tile is a whole number of micro-tiles");

// s[r][0 .. NVV * LANES) = q[r] . kt[:, 0 .. NVV * LANES) for R rows: q [R, D] (stride D), kt [D, BK] (stride BK),
// s [R, BK] (stride BK).
template <int R, int NVV>
inline void qk_tile(const float* q, int64_t D, const float* kt, float* s) {
  V acc[R][NVV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NVV; ++j) acc[r][j] = vzero();
  for (int64_t d = 0; d < D; ++d) {
    V k[NVV];
    for (int j = 0; j < NVV; ++j) k[j] = vload(kt + d * BK + j * LANES);
    for (int r = 0; r < R; ++r) {
      const V qv = vbroadcast(q + r * D + d);
      for (int j = 0; j < NVV; ++j) acc[r][j] = vfmadd(qv, k[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NVV; ++j) store(s + r * BK + j * LANES, acc[r][j]);
}

// o[r][0 .. NVV * LANES) += sum over k < nk of p[r][k] * v[k][0 .. NVV * LANES) for R rows: p [R, BK] (stride BK),
// v [nk, D] and o [R, D] (stride D).
template <int R, int NVV>
inline void pv_tile(const float* p, const float* v, int64_t D, int64_t nk, float* o) {
  V acc[R][NVV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NVV; ++j) acc[r][j] = vload(o + r * D + j * LANES);
  for (int64_t k = 0; k < nk; ++k) {
    V vv[NVV];
    for (int j = 0; j < NVV; ++j) vv[j] = vload(v + k * D + j * LANES);
    for (int r = 0; r < R; ++r) {
      const V pv = vbroadcast(p + r * BK + k);
      for (int j = 0; j < NVV; ++j) acc[r][j] = vfmadd(pv, vv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NVV; ++j) store(o + r * D + j * LANES, acc[r][j]);
}

// The micro-tiles with R (1 .. RR) and NVV (1 .. NV) known only at run time (a task's last rows, D's last vectors).
template <int R>
void pv_rows(int nvv, const float* p, const float* v, int64_t D, int64_t nk, float* o) {
  static_assert(NV == 4 || NV == 2);
  switch (nvv) {
    case 1: pv_tile<R, 1>(p, v, D, nk, o); break;
    case 2: pv_tile<R, 2>(p, v, D, nk, o); break;
    case 3: if constexpr (NV == 4) pv_tile<R, 3>(p, v, D, nk, o); break;
    default: if constexpr (NV == 4) pv_tile<R, 4>(p, v, D, nk, o);
  }
}

template <int R = RR>
void pv_any(int rows, int nvv, const float* p, const float* v, int64_t D, int64_t nk, float* o) {
  if constexpr (R > 1) {
    if (rows < R) return pv_any<R - 1>(rows, nvv, p, v, D, nk, o);
  }
  pv_rows<R>(nvv, p, v, D, nk, o);
}

template <int R = RR>
void qk_any(int rows, const float* q, int64_t D, const float* kt, float* s) {
  if constexpr (R > 1) {
    if (rows < R) return qk_any<R - 1>(rows, q, D, kt, s);
  }
  for (int64_t k = 0; k < BK; k += NV * LANES) qk_tile<R, NV>(q, D, kt + k, s + k);
}

inline float hmax(V v) {
  alignas(64) float lanes[LANES];
  store(lanes, v);
  return *std::max_element(lanes, lanes + LANES);
}

struct Task {
  int64_t seq, head, row_begin, row_end;  // query rows row_begin .. row_end - 1 of the sequence (chunk-local)
  int64_t cost;                           // keys x rows, to claim the heaviest first
};

// The buffers of one task (fp32): queries [rows, D], outputs [rows, D], scores [rows, BK], keys [D, BK],
// values [BK, D], running max and sum [rows].
struct Scratch {
  std::vector<float> q, o, s, kt, v, m, l;
};

// One task: the rows of positions ctx - n + i, i in [task.row_begin, task.row_end), and the group's heads.
template <typename T>
void attend_task(const Task& task, const T* query, const T* key_cache, const T* value_cache, const int32_t* table,
                 int64_t q_start, int64_t n, int64_t ctx, int64_t block_size, int64_t Hq, int64_t Hkv, int64_t D,
                 float scale, int64_t window, float softcap, T* out, Scratch& b) {
  const int64_t group = Hq / Hkv, h = task.head;
  const int64_t positions = task.row_end - task.row_begin, rows = positions * group;
  const int64_t first_pos = ctx - n + task.row_begin, last_pos = ctx - n + task.row_end - 1;
  b.q.resize(rows * D);
  b.o.assign(rows * D, 0.0f);
  b.s.resize(rows * BK);
  b.kt.resize(D * BK);
  b.v.resize(BK * D);
  b.m.assign(rows, NEG_INF);
  b.l.assign(rows, 0.0f);
  // row r = (position i, head g of the group): the group's heads of one position are contiguous in query
  for (int64_t i = 0; i < positions; ++i) {
    const T* src = query + ((q_start + task.row_begin + i) * Hq + h * group) * D;
    for (int64_t e = 0; e < group * D; e += LANES) store(b.q.data() + i * group * D + e, load_f32(src + e));
  }
  auto slot_row = [&](const T* cache, int64_t t) {
    const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
    return cache + (slot * Hkv + h) * D;
  };
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  for (int64_t kb = lo; kb <= last_pos; kb += BK) {
    const int64_t nk = std::min(BK, last_pos + 1 - kb);
    // keys transposed [D, BK] (zeros past nk), values [nk, D]
    std::fill(b.kt.begin(), b.kt.end(), 0.0f);
    for (int64_t k = 0; k < nk; ++k) {
      const T* kr = slot_row(key_cache, kb + k);
      for (int64_t d = 0; d < D; ++d) b.kt[d * BK + k] = to_f32(kr[d]);
      const T* vr = slot_row(value_cache, kb + k);
      for (int64_t d = 0; d < D; d += LANES) store(b.v.data() + k * D + d, load_f32(vr + d));
    }
    for (int64_t r = 0; r < rows; r += RR)
      qk_any(static_cast<int>(std::min<int64_t>(RR, rows - r)), b.q.data() + r * D, D, b.kt.data(),
             b.s.data() + r * BK);
    // online softmax over this tile; p replaces s (zeros outside each row's visible keys)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + r / group;
      float* s = b.s.data() + r * BK;
      const int64_t a = window > 0 ? std::clamp<int64_t>(pos - window + 1 - kb, 0, nk) : 0;
      const int64_t e = std::min<int64_t>(nk, pos + 1 - kb);
      if (e <= a) {  // no visible key in this tile
        std::fill(s, s + BK, 0.0f);
        continue;
      }
      const V sv = vbroadcast_value(scale);
      for (int64_t k = 0; k < BK; k += LANES) store(s + k, vmul(vload(s + k), sv));
      if (softcap > 0.0f)
        for (int64_t k = a; k < e; ++k) s[k] = softcap * std::tanh(s[k] / softcap);
      std::fill(s, s + a, NEG_INF);
      std::fill(s + e, s + BK, NEG_INF);
      V vm = vload(s);
      for (int64_t k = LANES; k < BK; k += LANES) vm = vmax(vm, vload(s + k));
      const float m_new = std::max(b.m[r], hmax(vm));
      const float alpha = std::exp(b.m[r] - m_new);  // (0 for the row's first visible tile)
      const V mv = vbroadcast_value(m_new);
      for (int64_t k = 0; k < BK; k += LANES) store(s + k, vexp(vsub(vload(s + k), mv)));
      std::fill(s, s + a, 0.0f);  // (vexp clamps: e^-inf came out as e^-87)
      std::fill(s + e, s + BK, 0.0f);
      V vs = vload(s);
      for (int64_t k = LANES; k < BK; k += LANES) vs = vadd(vs, vload(s + k));
      const float sum = hsum(vs);
      b.l[r] = b.l[r] * alpha + sum;
      b.m[r] = m_new;
      if (alpha != 1.0f) {
        float* o = b.o.data() + r * D;
        const V av = vbroadcast_value(alpha);
        for (int64_t d = 0; d < D; d += LANES) store(o + d, vmul(vload(o + d), av));
      }
    }
    for (int64_t r = 0; r < rows; r += RR) {
      const int rr = static_cast<int>(std::min<int64_t>(RR, rows - r));
      for (int64_t d = 0; d < D; d += NV * LANES)
        pv_any(rr, static_cast<int>(std::min<int64_t>(NV, (D - d) / LANES)), b.s.data() + r * BK, b.v.data() + d,
               D, nk, b.o.data() + r * D + d);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / group, g = r % group;
    T* dst = out + ((q_start + task.row_begin + i) * Hq + h * group + g) * D;
    const V inv = vbroadcast_value(b.l[r] > 0.0f ? 1.0f / b.l[r] : 0.0f);
    for (int64_t d = 0; d < D; d += LANES) store_f32(dst + d, vmul(vload(b.o.data() + r * D + d), inv));
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
      thread_local Scratch scratch;
      for (int64_t t = begin; t < end; ++t) {
        const Task& task = tasks[t];
        const int64_t s = task.seq;
        attend_task<T>(task, qp, kp, vp, bt + s * max_blocks, qsl[s], qsl[s + 1] - qsl[s], ctx_lens[s], block_size,
                       Hq, Hkv, D, static_cast<float>(scale), window, static_cast<float>(softcap), op, scratch);
      }
    });
  };
  if (query.scalar_type() == torch::kFloat) run(float{});
  else run(at::BFloat16{});
  return out;
}
