// Decode attention over the paged KV cache on x86-64 CPUs (fp32 or bf16; AVX2 + FMA or AVX-512): one query token
// per sequence attends to its context (or, with a sliding window, its last `window` tokens), read in place through
// the block table. Optional tanh soft-capping of the scores (Gemma 2: s = cap * tanh(s / cap), before the softmax).
//
// Why: the torch path gathers every sequence's K and V blocks into padded copies before attending
// (shared/attention.py), which at batch 8-32 writes and rereads megabytes per layer; here each K and V row is
// read from memory once, where it lies. At batch 32 a decode step's KV (30 layers) is hundreds of MB, so the
// kernel is bound by memory reads: it prefetches the rows (the hardware prefetchers miss them), and its
// arithmetic is kept below the read time (scores LANES tokens at a time, V rows weighed for several query rows
// per read: attend_one). Measured (`python -m tandem.benchmarks.decode_attention`, and against the per-token
// loop it replaced): docs/performance.md. Softmax is exact two-pass fp32 (scores, max, e^(s - max), sum), as the
// reference kernels/paged_attention.py paged_decode_attention_ref computes it; e^x is Cephes' polynomial (simd.h).
// A bf16 query and cache are widened to fp32 as they are loaded (exact); scores, softmax and the weighted sum of V are
// fp32, and the output is rounded to bf16 once (as the reference: fp32 math, then .to(bf16)).
//
// Layouts (those of shared/attention.py): query [S, Hq, D]; key_cache, value_cache [num_blocks, block_size, Hkv, D]
// (the query's dtype); block_tables int32 [S, max_blocks]; context_lens int32 [S]; Hq % Hkv == 0 (the query heads
// of KV head h are h * Hq / Hkv ... (h + 1) * Hq / Hkv - 1, as in HF's repeat_kv); D % LANES == 0.
//
// Quantized KV (kernels/kv_quant.py; kv_format 1 fp8 e4m3, 2 fp8 e5m2, 3 int8): the caches are uint8
// [num_blocks, block_size, Hkv, row]: fp8 rows are D codes (scale 1), int8 rows D codes then the fp32 scale of that
// token and head (row D + 4). The codes are widened to fp32 in registers as they are read (fp8 by bit
// manipulation, int8 by sign extension; no dequantized copy); an int8 row's scale factors out of it: score =
// scale * (q . codes_k), and V's weight is p * scale_v.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

#include "simd.h"
#include "thread_pool.h"

namespace {
using namespace tandem_simd;

constexpr int MAX_DV = 256 / LANES;  // head_dim up to 256
enum KVFormat : int64_t { KV_FLOAT = 0, KV_FP8_E4M3 = 1, KV_FP8_E5M2 = 2, KV_INT8 = 3 };  // kv_quant.KV_QUANT_IDS
constexpr int64_t SCALE_BYTES = 4;
// Elements of one cache row: D for a float cache and fp8, D + the fp32 scale for int8 (kv_quant.row_size).
constexpr bool row_scaled(int64_t fmt) { return fmt == KV_INT8; }
inline int64_t row_elems(int64_t fmt, int64_t D) { return row_scaled(fmt) ? D + SCALE_BYTES : D; }

// LANES bytes widened to int32 lanes (zero- or sign-extended), and the integer ops the fp8 decoding needs.
#ifdef __AVX512F__
using VI = __m512i;
inline VI widen_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VI widen_i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VI iand(VI a, int m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
inline VI iadd(VI a, int c) { return _mm512_add_epi32(a, _mm512_set1_epi32(c)); }
inline VI ior(VI a, VI b) { return _mm512_or_si512(a, b); }
template <int N>
inline VI ishl(VI a) { return _mm512_slli_epi32(a, N); }
inline V as_float(VI a) { return _mm512_castsi512_ps(a); }
inline VI as_int(V a) { return _mm512_castps_si512(a); }
inline V to_float(VI a) { return _mm512_cvtepi32_ps(a); }
// lanes where a < c take x, the others y
inline V select_less(VI a, int c, V x, V y) { return _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(c)), y, x); }
#else
using VI = __m256i;
inline VI widen_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline VI widen_i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline VI iand(VI a, int m) { return _mm256_and_si256(a, _mm256_set1_epi32(m)); }
inline VI iadd(VI a, int c) { return _mm256_add_epi32(a, _mm256_set1_epi32(c)); }
inline VI ior(VI a, VI b) { return _mm256_or_si256(a, b); }
template <int N>
inline VI ishl(VI a) { return _mm256_slli_epi32(a, N); }
inline V as_float(VI a) { return _mm256_castsi256_ps(a); }
inline VI as_int(V a) { return _mm256_castps_si256(a); }
inline V to_float(VI a) { return _mm256_cvtepi32_ps(a); }
inline V select_less(VI a, int c, V x, V y) {
  return _mm256_blendv_ps(y, x, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(c), a)));
}
#endif

// LANES codes of format FMT at p as fp32 (unscaled). fp8 (OCP e4m3fn / e5m2): sign | exponent | mantissa; a normal
// code's exponent and mantissa shifted into fp32's place, the exponent rebiased (127 - 7 or 127 - 15); a subnormal
// code (exponent 0) is its mantissa times 2^-9 or 2^-16. NaN and inf codes never occur (quantize clamps to qmax).
template <int FMT>
inline V load_codes(const uint8_t* p) {
  if constexpr (FMT == KV_INT8) {
    return to_float(widen_i8(p));
  } else {
    constexpr bool e4m3 = FMT == KV_FP8_E4M3;
    const VI b = widen_u8(p);
    const VI em = iand(b, 0x7F);
    const V normal = as_float(iadd(ishl<e4m3 ? 20 : 21>(em), (e4m3 ? 120 : 112) << 23));
    const V subnormal = vmul(to_float(em), vbroadcast_value(e4m3 ? 1.0f / 512 : 1.0f / 65536));
    const V v = select_less(em, e4m3 ? 8 : 4, subnormal, normal);
    return as_float(ior(as_int(v), ishl<24>(iand(b, 0x80))));
  }
}

// One row of a cache as fp32: LANES elements of T (a float cache), or of codes (FMT != KV_FLOAT).
template <int FMT, typename C>
inline V load_row(const C* p) {
  if constexpr (FMT == KV_FLOAT) return load_f32(p);
  else return load_codes<FMT>(p);
}

// The scale of a row of D codes (int8; 1 for a float cache and fp8).
template <int FMT, typename C>
inline float row_scale(const C* row, int64_t D) {
  if constexpr (!row_scaled(FMT)) {
    return 1.0f;
  } else {
    float scale;
    std::memcpy(&scale, row + D, sizeof(float));
    return scale;
  }
}

// r[i] = the sum of v[i]'s lanes, for LANES vectors v: a transpose-and-add tree (LANES - 1 adds and twice as many
// shuffles for LANES sums, against a horizontal reduction's log2(LANES) shuffles and adds for each).
#ifdef __AVX512F__
inline V hsum_lanes(const V* v) {
  V t[8], u[4], w[2];
  // t[i], per 128-bit lane: partial sums of v[2i] and v[2i + 1], interleaved
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  // u[j], per 128-bit lane L: the partial sums over L of v[4j] .. v[4j + 3]
  for (int j = 0; j < 4; ++j)
    u[j] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * j], t[2 * j + 1], 0x44),
                         _mm512_shuffle_ps(t[2 * j], t[2 * j + 1], 0xEE));
  for (int j = 0; j < 2; ++j)  // w[j]: u[2j]'s lanes 0 + 1, 2 + 3, then u[2j + 1]'s
    w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}
constexpr int PV_ROWS = 4;  // query rows per pass over V: PV_ROWS x PV_VECS accumulators in registers
#else
inline V hsum_lanes(const V* v) {
  V t[4], u[2];
  for (int i = 0; i < 4; ++i)
    t[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 2; ++j)
    u[j] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * j], t[2 * j + 1], 0x44),
                         _mm256_shuffle_ps(t[2 * j], t[2 * j + 1], 0xEE));
  return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}
constexpr int PV_ROWS = 2;
#endif
constexpr int PV_VECS = 4;  // vectors of a V row per pass
constexpr int64_t PREFETCH_CHUNKS = 8;  // how far ahead the K rows are fetched, in chunks of LANES tokens

// Every 64-byte line of bytes at p into L2.
inline void prefetch_row(const void* p, int64_t bytes) { Prefetch(p, bytes).step(bytes); }

// What one thread reuses from one (sequence, KV head) to the next.
struct Scratch {
  std::vector<int64_t> offsets;  // [padded] each token's row in the caches (the tail: the last token's again)
  std::vector<float> q;          // [group, D] the query rows in fp32
  std::vector<float> scores;     // [group, padded] scores, then their e^(s - max)
  std::vector<float> weights;    // [group] 1 / the sum of a row's e^(s - max)
};

// acc[r][c] (fp32) += sum over tokens t of p[r][t] * V[t][d0 + c lanes] for NR query rows and NV vectors of a V row
// from column vector d0, then out rows = acc * their weights. p[r] = scores + r * padded (already e^(s - max)).
template <int NR, int NV, typename T, int FMT, typename C>
void weigh_values(const C* value_cache, const int64_t* offsets, int64_t n, const float* p, int64_t padded,
                  const float* weights, int64_t D, int64_t d0, T* out) {
  V acc[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = vzero();
  for (int64_t t = 0; t < n; ++t) {
    const C* v = value_cache + offsets[t];
    const float vs = row_scale<FMT>(v, D);
    V w[NR];
    for (int r = 0; r < NR; ++r) w[r] = vbroadcast_value(row_scaled(FMT) ? p[r * padded + t] * vs : p[r * padded + t]);
    for (int c = 0; c < NV; ++c) {
      const V x = load_row<FMT>(v + (d0 + c) * LANES);
      for (int r = 0; r < NR; ++r) acc[r][c] = vfmadd(w[r], x, acc[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NV; ++c)
      store_f32(out + r * D + (d0 + c) * LANES, vmul(acc[r][c], vbroadcast_value(weights[r])));
}

template <int NR, typename T, int FMT, typename C>
void weigh_values_rows(const C* value_cache, const int64_t* offsets, int64_t n, const float* p, int64_t padded,
                       const float* weights, int64_t D, T* out) {
  const int64_t dv = D / LANES;
  int64_t d0 = 0;
  for (; d0 + PV_VECS <= dv; d0 += PV_VECS)
    weigh_values<NR, PV_VECS, T, FMT>(value_cache, offsets, n, p, padded, weights, D, d0, out);
  if (d0 + 2 <= dv) {
    weigh_values<NR, 2, T, FMT>(value_cache, offsets, n, p, padded, weights, D, d0, out);
    d0 += 2;
  }
  if (d0 < dv) weigh_values<NR, 1, T, FMT>(value_cache, offsets, n, p, padded, weights, D, d0, out);
}

// out [group, D] = softmax(q k^T * scale) v for the query rows q [group, D] of one sequence and KV head h, over its
// tokens first..ctx-1 (blocks before first's are never read). T: float or at::BFloat16; C: the caches' element
// type, T (FMT KV_FLOAT) or uint8_t (a quantized format, rows of row_elems(FMT, D)).
// Scores: LANES tokens at a time, each query row's products with the LANES key rows summed to one vector of
// scores by hsum_lanes. Weighted values: each V row read once per PV_ROWS query rows and PV_VECS vectors of the row,
// their accumulators in registers.
template <typename T, int FMT, typename C>
void attend_one(const T* q, int64_t group, const C* key_cache, const C* value_cache, const int32_t* block_table,
                int64_t first, int64_t ctx, int64_t block_size, int64_t num_kv_heads, int64_t h, int64_t D,
                float scale, float softcap, T* out, Scratch& scratch) {
  const int64_t dv = D / LANES;
  const int64_t n = ctx - first;
  const int64_t padded = (n + LANES - 1) / LANES * LANES;
  const int64_t row_size = row_elems(FMT, D);
  scratch.offsets.resize(padded);
  scratch.q.resize(group * D);
  scratch.scores.resize(group * padded);
  scratch.weights.resize(group);
  int64_t* offsets = scratch.offsets.data();
  for (int64_t i = 0, b = first / block_size, o = first % block_size; i < n; ++i) {
    offsets[i] = ((static_cast<int64_t>(block_table[b]) * block_size + o) * num_kv_heads + h) * row_size;
    if (++o == block_size) o = 0, ++b;
  }
  std::fill(offsets + n, offsets + padded, offsets[n - 1]);
  float* qf = scratch.q.data();
  for (int64_t i = 0; i < group * dv; ++i) store(qf + i * LANES, load_f32(q + i * LANES));

  // Software prefetch into L2, which the hardware prefetchers do not do for rows that hop from block to block and
  // skip the other heads' rows: the K rows PREFETCH_CHUNKS chunks ahead, and each chunk's V rows (read again after
  // every score). Measured (2 threads, 32 sequences of 150 tokens, fp32, caches out of L3): 18-22 GB/s against 12
  // without (docs/performance.md).
  const int64_t row_bytes = row_size * static_cast<int64_t>(sizeof(C));
  for (int64_t i = 0; i < std::min(padded, PREFETCH_CHUNKS * LANES); ++i)
    prefetch_row(key_cache + offsets[i], row_bytes);
  for (int64_t c = 0; c < padded; c += LANES) {
    for (int64_t i = c + PREFETCH_CHUNKS * LANES; i < std::min(padded, c + (PREFETCH_CHUNKS + 1) * LANES); ++i)
      prefetch_row(key_cache + offsets[i], row_bytes);
    for (int64_t i = c; i < std::min(n, c + LANES); ++i) prefetch_row(value_cache + offsets[i], row_bytes);
    V chunk_scale = vbroadcast_value(scale);
    if constexpr (row_scaled(FMT)) {
      float ks[LANES];
      for (int j = 0; j < LANES; ++j) ks[j] = row_scale<FMT>(key_cache + offsets[c + j], D);
      chunk_scale = vmul(vload(ks), chunk_scale);
    }
    for (int64_t r = 0; r < group; ++r) {
      const float* qr = qf + r * D;
      V acc[LANES];
      for (int j = 0; j < LANES; ++j) {
        const C* k = key_cache + offsets[c + j];
        V a0 = vmul(vload(qr), load_row<FMT>(k)), a1 = vzero();  // (two chains)
        for (int64_t d = 1; d + 1 < dv; d += 2) {
          a1 = vfmadd(vload(qr + d * LANES), load_row<FMT>(k + d * LANES), a1);
          a0 = vfmadd(vload(qr + (d + 1) * LANES), load_row<FMT>(k + (d + 1) * LANES), a0);
        }
        if (dv % 2 == 0) a1 = vfmadd(vload(qr + (dv - 1) * LANES), load_row<FMT>(k + (dv - 1) * LANES), a1);
        acc[j] = vadd(a0, a1);
      }
      store(scratch.scores.data() + r * padded + c, vmul(hsum_lanes(acc), chunk_scale));
    }
  }
  for (int64_t r = 0; r < group; ++r) {
    float* s = scratch.scores.data() + r * padded;
    if (softcap > 0.0f)
      for (int64_t t = 0; t < padded; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
    V mv = vload(s);  // (the tail repeats the last token's score: it does not move the max)
    for (int64_t t = LANES; t < padded; t += LANES) mv = vmax(mv, vload(s + t));
    float lanes[LANES];
    store(lanes, mv);
    const float m = *std::max_element(lanes, lanes + LANES);
    const V m_v = vbroadcast_value(m);
    for (int64_t t = 0; t < padded; t += LANES) store(s + t, vexp(vsub(vload(s + t), m_v)));
    std::fill(s + n, s + padded, 0.0f);  // (nor the sum)
    V sum = vload(s);
    for (int64_t t = LANES; t < padded; t += LANES) sum = vadd(sum, vload(s + t));
    scratch.weights[r] = 1.0f / hsum(sum);
  }
  const float* p = scratch.scores.data();
  const float* weights = scratch.weights.data();
  int64_t r = 0;
  for (; r + PV_ROWS <= group; r += PV_ROWS)
    weigh_values_rows<PV_ROWS, T, FMT>(value_cache, offsets, n, p + r * padded, padded, weights + r, D, out + r * D);
  if (PV_ROWS == 4 && r + 2 <= group) {
    weigh_values_rows<2, T, FMT>(value_cache, offsets, n, p + r * padded, padded, weights + r, D, out + r * D);
    r += 2;
  }
  if (r < group)
    weigh_values_rows<1, T, FMT>(value_cache, offsets, n, p + r * padded, padded, weights + r, D, out + r * D);
}

}  // namespace

// query [S, Hq, D]; key_cache, value_cache [num_blocks, block_size, Hkv, D] (all fp32 or all bf16; with kv_format
// 1-3, uint8 [num_blocks, block_size, Hkv, D], int8's D + 4); block_tables int32 [S, max_blocks]; context_lens int32 [S];
// window: attend to the last `window` tokens only (0: all); softcap: cap the scores (0: none) -> out [S, Hq, D] of
// the query's dtype (zeros for a context of 0 tokens). Block-table entries before the window are never read (nor
// checked).
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t window, double softcap, int64_t kv_format) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "query must be [S, Hq, D] and the caches [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(query.scalar_type() == torch::kFloat || query.scalar_type() == torch::kBFloat16,
              "query must be fp32 or bf16");
  TORCH_CHECK(kv_format >= KV_FLOAT && kv_format <= KV_INT8, "kv_format must be 0 (float) or 1-3 (quantized)");
  const auto cache_type = kv_format == KV_FLOAT ? query.scalar_type() : torch::kByte;
  TORCH_CHECK(query.is_contiguous(), "query must be contiguous");
  for (const auto* t : {&key_cache, &value_cache})
    TORCH_CHECK(t->scalar_type() == cache_type && t->is_contiguous(),
                "query and caches must be contiguous and of one dtype (fp32 or bf16; uint8 caches for quantized KV)");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt && context_lens.scalar_type() == torch::kInt &&
                  block_tables.is_contiguous() && context_lens.is_contiguous(),
              "block_tables and context_lens must be contiguous int32");
  const int64_t S = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t block_size = key_cache.size(1), Hkv = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == row_elems(kv_format, D) && D % LANES == 0 && D <= MAX_DV * LANES,
              "head_dim must match (+ 4 scale bytes for int8 KV), be a multiple of the SIMD width and at most 256");
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
  auto run = [&](auto zero, auto cache_zero, auto format) {
    using T = decltype(zero);
    using C = decltype(cache_zero);
    constexpr int FMT = decltype(format)::value;
    const T* qp = query.data_ptr<T>();
    const C* kp = key_cache.data_ptr<C>();
    const C* vp = value_cache.data_ptr<C>();
    T* op = out.data_ptr<T>();
    tandem_pool::parallel_for(S * Hkv, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t s = i / Hkv, h = i % Hkv;
        if (ctx_lens[s] == 0) continue;
        const int64_t offset = (s * Hq + h * group) * D;
        const int64_t first = window > 0 ? std::max<int64_t>(0, ctx_lens[s] - window) : 0;
        attend_one<T, FMT>(qp + offset, group, kp, vp, bt + s * max_blocks, first, ctx_lens[s], block_size, Hkv, h, D,
                   static_cast<float>(scale), static_cast<float>(softcap), op + offset, scratch);
      }
    });
  };
  auto run_query = [&](auto zero) {
    using T = decltype(zero);
    switch (kv_format) {
      case KV_FP8_E4M3: run(zero, uint8_t{}, std::integral_constant<int, KV_FP8_E4M3>{}); break;
      case KV_FP8_E5M2: run(zero, uint8_t{}, std::integral_constant<int, KV_FP8_E5M2>{}); break;
      case KV_INT8: run(zero, uint8_t{}, std::integral_constant<int, KV_INT8>{}); break;
      default: run(zero, T{}, std::integral_constant<int, KV_FLOAT>{});
    }
  };
  if (query.scalar_type() == torch::kFloat) run_query(float{});
  else run_query(at::BFloat16{});
  return out;
}
