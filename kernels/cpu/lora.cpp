// The batched LoRA delta of a mixed-adapter batch on x86-64 CPUs with AVX2 + FMA or AVX-512: Punica's SGMV
// (Chen et al. 2023, arXiv 2310.18547; S-LoRA, Sheng et al. 2023), a shrink then an expand per segment of rows.
//
// For each segment s (rows start_s .. + len_s of x and y, adapter slot a_s):
//   h [len_s, R] = x[rows] @ lora_a[a_s].T        (shrink: fp32 products and sums, h kept in fp32)
//   y[rows]     += T(h @ lora_b[a_s].T)            (expand: fp32, the delta rounded once to y's type T, then added
//                                                   in T: y = T(y + T(delta)), as kernels/lora.py add_lora_ref does)
// T is fp32 or bf16 (widened to fp32 in registers: exact). Rows in no segment are not touched.
//
// Two phases, each one parallel_for on the kernels' thread pool (thread_pool.h), each over the rows of all
// segments of one slot together (h is ordered slot by slot, with a map back to rows of x and y: a decode batch's
// requests on one adapter read its lora_a and lora_b once per tile):
// - shrink: tasks of up to SHRINK_ROWS rows by up to SHRINK_RANKS rows of lora_a; register tiles of SHRINK_MT rows
//   of x by SHRINK_NT rows of lora_a, dot products over K (K is long: one horizontal sum per K).
// - expand: tasks of up to EXPAND_ROWS rows by up to NB columns of y. The inner dimension is the rank (1 to a few
//   dozen). Each output is summed in one order, whatever the batch (batch invariance): LANES partial sums, lane l
//   over r = l, l + LANES, ... (fp32 FMAs from zero), then added in sum_each's fixed tree. Two paths keep it: dot
//   products over R, LANES columns at a time, the partials summed by sum_each (a transposing reduction); and, for
//   a task of at least PACK_MIN_ROWS rows at rank up to PACK_MAX_RANK, lora_b's NB x R block packed transposed into
//   fp32 and outer products, each lane's partial sum in turn, added in the same tree. In bf16, from 2 rows, the dot
//   products read the block of lora_b widened to fp32 once. So a row's bits depend neither on how many rows share
//   its adapter, nor on its place in the batch, nor on the kernel threads (they split rows and columns, never R or
//   K); they may differ between an AVX-512 and an AVX2 build (LANES and the tree differ).
// - the shrink is invariant too: each h[m, r] one chain of FMAs over K by vectors, one hsum, a scalar tail.
// Decode (many 1-row segments: a BGMV) spreads over slots x rank or column blocks; a prefill segment (hundreds of
// rows) over row blocks x rank or column blocks.
//
// Any K, N and R: the SIMD loops end with scalar tails. Layouts: x [T, K] and y [T, N] with unit column stride (any
// row stride: y may be a column slice of a fused output), lora_a [L, R, K] and lora_b [L, N, R] contiguous,
// seg_starts / seg_lens / seg_slots int64 [S] contiguous. Segments must lie inside [0, T), not overlap, and name a
// slot in [0, L): ValueError otherwise (checked here, before any work).
#include <torch/extension.h>

#include "simd.h"
#include "thread_pool.h"

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {
using namespace tandem_simd;

struct Segment {
  int64_t start, len, slot;
  int64_t h_row;  // its first row in h (h holds the segments' rows back to back, slot by slot)
};

template <typename T>
inline void add_delta(T* y, float delta) {  // y = T(y + T(delta)): torch's `y += delta.to(T)`
  *y = from_f32<T>(to_f32(*y) + round_to<T>(delta));
}

// ---- shrink: h[m, r] = sum_k x[m, k] * a[r, k] -------------------------------------------------------------------

constexpr int SHRINK_NT = 4;                          // rows of lora_a per register tile
constexpr int SHRINK_MT = LANES == 16 ? 6 : 2;        // rows of x per register tile: NT * MT + NT + 1 vectors
constexpr int64_t SHRINK_ROWS = 8 * SHRINK_MT;        // rows of x per task
constexpr int64_t SHRINK_RANKS = 4 * SHRINK_NT;       // rows of lora_a per task

// h[i * ldh + j] for i < ROWS, j < ranks (<= SHRINK_NT), from the rows xr[i] of x; a: the first of those rows of
// lora_a (absent rows read it again and are not stored).
template <int ROWS, typename T>
inline void shrink_tile(const T* const* xr, const T* a, int64_t K, int ranks, float* h, int64_t ldh) {
  const T* ar[SHRINK_NT];
  V acc[SHRINK_NT][ROWS];
  for (int j = 0; j < SHRINK_NT; ++j) {
    ar[j] = a + (j < ranks ? j : 0) * K;
    for (int i = 0; i < ROWS; ++i) acc[j][i] = vzero();
  }
  const int64_t k_vec = K - K % LANES;
  for (int64_t k = 0; k < k_vec; k += LANES) {
    V av[SHRINK_NT];
    for (int j = 0; j < SHRINK_NT; ++j) av[j] = load_f32(ar[j] + k);
    for (int i = 0; i < ROWS; ++i) {
      const V xv = load_f32(xr[i] + k);
      for (int j = 0; j < SHRINK_NT; ++j) acc[j][i] = vfmadd(av[j], xv, acc[j][i]);
    }
  }
  for (int j = 0; j < ranks; ++j) {
    for (int i = 0; i < ROWS; ++i) {
      float sum = k_vec > 0 ? hsum(acc[j][i]) : 0.0f;
      for (int64_t k = k_vec; k < K; ++k) sum += to_f32(xr[i][k]) * to_f32(ar[j][k]);
      h[i * ldh + j] = sum;
    }
  }
}

template <int ROWS, typename T>
inline void shrink_rows_left(const T* const* xr, const T* a, int64_t K, int ranks, float* h, int64_t ldh,
                             int64_t rows) {
  if constexpr (ROWS > 0) {
    if (rows == ROWS) return shrink_tile<ROWS>(xr, a, K, ranks, h, ldh);
    shrink_rows_left<ROWS - 1>(xr, a, K, ranks, h, ldh, rows);
  }
}

// Columns r0 .. r1 of M rows of h (ldh floats apart), against a = lora_a[slot] [R, K]; row m of h is row
// x_rows[m] of x.
template <typename T>
void shrink_block(const T* x, int64_t ldx, const int64_t* x_rows, const T* a, int64_t M, int64_t K, int64_t r0,
                  int64_t r1, float* h, int64_t ldh) {
  const T* xr[SHRINK_MT];
  for (int64_t m = 0; m < M; m += SHRINK_MT) {
    const int64_t rows = std::min<int64_t>(SHRINK_MT, M - m);
    for (int64_t i = 0; i < rows; ++i) xr[i] = x + x_rows[m + i] * ldx;
    for (int64_t r = r0; r < r1; r += SHRINK_NT) {
      const int ranks = static_cast<int>(std::min<int64_t>(SHRINK_NT, r1 - r));
      if (rows == SHRINK_MT) shrink_tile<SHRINK_MT>(xr, a + r * K, K, ranks, h + m * ldh + r, ldh);
      else shrink_rows_left<SHRINK_MT - 1>(xr, a + r * K, K, ranks, h + m * ldh + r, ldh, rows);
    }
  }
}

// ---- expand: y[m, n] += T(sum_r h[m, r] * b[n, r]) ---------------------------------------------------------------

constexpr int64_t NB = 256;                       // columns of y per task
constexpr int64_t EXPAND_ROWS = 256;              // rows per task (the packed path packs once per task)
// rows of a task from which it packs lora_b, and the largest rank it packs at (else dot products: both sum in one
// order). python -m tandem.benchmarks.lora_kernel, 512 rows on 2 threads here (AVX-512, one unpaired run): time
// packed / dot products about 0.4 at rank 8, 0.6 at 32, 1.5 at 48, 1.3 at 64 (the sum tree's adds, per output)
constexpr int64_t PACK_MIN_ROWS = 8;
constexpr int64_t PACK_MAX_RANK = 32;
constexpr int EXPAND_MT = 2;                      // rows per register tile of the packed path
constexpr int EXPAND_NV = LANES == 16 ? 2 : 1;    // vectors of columns per register tile (4 tiles live in the sum)
constexpr int64_t COLS = EXPAND_NV * LANES;       // columns per register tile (NB is a multiple)
constexpr int64_t BT_STRIDE = NB + LANES;         // floats per row of packed lora_b (not a power of two: a column
                                                  // of it would fall into few cache sets)

// The first n < LANES elements at p as fp32, zeros after (nothing past them is read).
#ifdef __AVX512F__
inline V load_head(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
#else
inline V load_head(const float* p, int64_t n) {
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
#endif
inline V load_head(const at::BFloat16* p, int64_t n) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m256i bits = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#else
  at::BFloat16 head[LANES] = {};
  std::copy(p, p + n, head);
  return load_f32(head);
#endif
}

// Lane j of the result: the sum of the lanes of a[j] (a transposing reduction tree: about 3 instructions per
// output where a horizontal sum per output takes 8).
#ifdef __AVX512F__
inline V sum_each(const V a[LANES]) {
  V u[8], w[4];
  for (int k = 0; k < 8; ++k)  // per 128-bit block: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] of a = a[2k], b = a[2k + 1]
    u[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
  for (int k = 0; k < 4; ++k)  // per 128-bit block: that block's sums of a[4k .. 4k + 3]
    w[k] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // the four blocks of each w[k] added: block k of the result holds the sums of a[4k .. 4k + 3]
  const V x0 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const V x1 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(3, 1, 3, 1)));
}
#else
inline V sum_each(const V a[LANES]) {
  // per 128-bit half: [a0 + a1, a2 + a3, b0 + b1, b2 + b3], then that half's sums of a[0 .. 3] and of a[4 .. 7]
  const V w0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const V w1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(w0, w1, 0x20), _mm256_permute2f128_ps(w0, w1, 0x31));
}
#endif

// y[c] += T(delta[c]) for c < cols (<= LANES).
template <typename T>
inline void add_deltas(T* y, V delta, int64_t cols) {
  if (cols == LANES) {
    store_f32(y, vadd(load_f32(y), round_to<T>(delta)));
  } else {
    float d[LANES];
    store(d, delta);
    for (int64_t c = 0; c < cols; ++c) add_delta(y + c, d[c]);
  }
}

// Dot-product path, one row: y[j] for j < cols (<= LANES), h: the row (R floats, zero-padded to a whole vector);
// b: lora_b's row of the first column, of y's type or widened to fp32 (absent columns read it again and are not
// stored).
template <typename TB, typename T>
inline void expand_dot(const float* h, int64_t R, const TB* b, int64_t cols, T* y) {
  const TB* br[LANES];
  V acc[LANES];
  for (int j = 0; j < LANES; ++j) {
    br[j] = b + (j < cols ? j : 0) * R;
    acc[j] = vzero();
  }
  int64_t r = 0;
  for (; r + LANES <= R; r += LANES) {
    const V hv = vload(h + r);
    for (int j = 0; j < LANES; ++j) acc[j] = vfmadd(load_f32(br[j] + r), hv, acc[j]);
  }
  if (r < R) {
    const V hv = vload(h + r);
    for (int j = 0; j < LANES; ++j) acc[j] = vfmadd(load_head(br[j] + r, R - r), hv, acc[j]);
  }
  add_deltas(y, sum_each(acc), cols);
}

// bt [R, BT_STRIDE] fp32: columns 0 .. cols of b [cols, R] transposed, zero from cols to width.
template <typename T>
void pack_transposed(const T* b, int64_t R, int64_t cols, int64_t width, float* bt) {
  // (row by row of b: its R values go to R rows of bt, BT_STRIDE apart, which spread over the cache's sets)
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t r = 0; r < R; ++r) bt[r * BT_STRIDE + j] = to_f32(b[j * R + r]);
  for (int64_t r = 0; r < R; ++r) std::fill(bt + r * BT_STRIDE + cols, bt + r * BT_STRIDE + width, 0.0f);
}

// Packed path: outer products, in the dot-product path's order. A register tile of ROWS rows by EXPAND_NV vectors
// of columns; `lane(l)` is its partial sum over r = l, l + LANES, ... (fp32 FMAs from zero, as a lane of
// expand_dot's accumulators), and the partials are added in sum_each's tree. A lane with no r (l >= R) holds +0
// there, which adds nothing (no partial sum is -0: a sum from +0 is -0 only if all its terms are), so it is left out.
template <int ROWS>
struct PackedTile {
  V v[ROWS][EXPAND_NV];
  bool some;  // false: a lane past R (zero)
};

template <int ROWS>
__attribute__((always_inline)) inline PackedTile<ROWS> add_tiles(const PackedTile<ROWS>& a, const PackedTile<ROWS>& b) {
  if (!b.some) return a;
  PackedTile<ROWS> s = a;
  for (int i = 0; i < ROWS; ++i)
    for (int v = 0; v < EXPAND_NV; ++v) s.v[i][v] = vadd(a.v[i][v], b.v[i][v]);
  return s;
}

template <int ROWS>
__attribute__((always_inline)) inline PackedTile<ROWS> lane_sum(const float* h, int64_t ldh, int64_t R, const float* bt, int l) {
  PackedTile<ROWS> t;
  t.some = l < R;
  for (int i = 0; i < ROWS; ++i)
    for (int v = 0; v < EXPAND_NV; ++v) t.v[i][v] = vzero();
  for (int64_t r = l; r < R; r += LANES) {
    V bv[EXPAND_NV];
    for (int v = 0; v < EXPAND_NV; ++v) bv[v] = vload(bt + r * BT_STRIDE + v * LANES);
    for (int i = 0; i < ROWS; ++i) {
      const V hv = vbroadcast(h + i * ldh + r);
      for (int v = 0; v < EXPAND_NV; ++v) t.v[i][v] = vfmadd(bv[v], hv, t.v[i][v]);
    }
  }
  return t;
}

// yr[i][c] for i < ROWS, c < cols (<= COLS), from bt's columns (COLS of them, zero past cols).
template <int ROWS, typename T>
inline void expand_packed_tile(const float* h, int64_t ldh, int64_t R, const float* bt, int64_t cols,
                               T* const* yr) {
  const auto lane = [&](int l) __attribute__((always_inline)) { return lane_sum<ROWS>(h, ldh, R, bt, l); };
#ifdef __AVX512F__
  // sum_each: per block of 4 lanes (l0 + l2) + (l1 + l3), then (block 0 + block 1) + (block 2 + block 3)
  const auto block = [&](int q) __attribute__((always_inline)) {
    return add_tiles(add_tiles(lane(4 * q), lane(4 * q + 2)), add_tiles(lane(4 * q + 1), lane(4 * q + 3)));
  };
  const PackedTile<ROWS> sum = add_tiles(add_tiles(block(0), block(1)), add_tiles(block(2), block(3)));
#else
  // sum_each: per half (l0 + l1) + (l2 + l3), then half 0 + half 1
  const auto half = [&](int q) __attribute__((always_inline)) {
    return add_tiles(add_tiles(lane(4 * q), lane(4 * q + 1)), add_tiles(lane(4 * q + 2), lane(4 * q + 3)));
  };
  const PackedTile<ROWS> sum = add_tiles(half(0), half(1));
#endif
  for (int i = 0; i < ROWS; ++i)
    for (int v = 0; v < EXPAND_NV && v * LANES < cols; ++v)
      add_deltas(yr[i] + v * LANES, sum.v[i][v], std::min<int64_t>(LANES, cols - v * LANES));
}

// out [n] fp32 = b [n] widened (bf16: exact).
template <typename T>
void widen(const T* b, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) store(out + i, load_f32(b + i));
  for (; i < n; ++i) out[i] = to_f32(b[i]);
}

// Columns n0 .. n1 of M rows of y += T(h [M, R] @ b.T), b = lora_b[slot] [N, R]; h's rows ldh floats apart, row m
// of h is row y_rows[m] of y.
template <typename T>
void expand_block(const float* h, int64_t ldh, const int64_t* y_rows, T* y, int64_t ldy, const T* b, int64_t M,
                  int64_t R, int64_t n0, int64_t n1) {
  if (M >= PACK_MIN_ROWS && R <= PACK_MAX_RANK) {
    thread_local std::vector<float> bt;  // [R, BT_STRIDE]
    if (static_cast<int64_t>(bt.size()) < R * BT_STRIDE) bt.resize(R * BT_STRIDE);
    const int64_t width = (n1 - n0 + COLS - 1) / COLS * COLS;
    pack_transposed(b + n0 * R, R, n1 - n0, width, bt.data());
    T* yr[EXPAND_MT];
    for (int64_t c = 0; c < width; c += COLS) {
      const int64_t cols = std::min<int64_t>(COLS, n1 - n0 - c);
      int64_t m = 0;
      for (; m + EXPAND_MT <= M; m += EXPAND_MT) {
        for (int i = 0; i < EXPAND_MT; ++i) yr[i] = y + y_rows[m + i] * ldy + n0 + c;
        expand_packed_tile<EXPAND_MT>(h + m * ldh, ldh, R, bt.data() + c, cols, yr);
      }
      for (; m < M; ++m) {
        yr[0] = y + y_rows[m] * ldy + n0 + c;
        expand_packed_tile<1>(h + m * ldh, ldh, R, bt.data() + c, cols, yr);
      }
    }
    return;
  }
  if constexpr (!std::is_same_v<T, float>) {
    if (M >= 2) {  // rows of one slot: lora_b's block widened once, for all of them
      thread_local std::vector<float> wide;  // [n1 - n0, R]
      if (static_cast<int64_t>(wide.size()) < NB * R) wide.resize(NB * R);
      widen(b + n0 * R, (n1 - n0) * R, wide.data());
      for (int64_t n = n0; n < n1; n += LANES)  // (columns outer: their block of lora_b stays in L1)
        for (int64_t m = 0; m < M; ++m)
          expand_dot(h + m * ldh, R, wide.data() + (n - n0) * R, std::min<int64_t>(LANES, n1 - n),
                     y + y_rows[m] * ldy + n);
      return;
    }
  }
  for (int64_t n = n0; n < n1; n += LANES)
    for (int64_t m = 0; m < M; ++m)
      expand_dot(h + m * ldh, R, b + n * R, std::min<int64_t>(LANES, n1 - n), y + y_rows[m] * ldy + n);
}

// ---- the two phases ---------------------------------------------------------------------------------------------

// The work of a call: the segments, and h's rows ordered slot by slot, so that all the rows of one adapter (a decode
// batch's requests sharing it) expand together, reading its lora_b once per block of columns.
struct Plan {
  std::vector<Segment> groups;    // per slot used: h rows h_row .. + len, in row order of their segments
  std::vector<int64_t> y_rows;    // h row -> its row of x and y
};

// The plan, after the checks (ValueError): segments inside [0, T), not overlapping, slots in [0, L).
Plan plan(const torch::Tensor& starts, const torch::Tensor& lens, const torch::Tensor& slots, int64_t T, int64_t L) {
  for (const auto* t : {&starts, &lens, &slots})
    TORCH_CHECK_VALUE(t->dim() == 1 && t->scalar_type() == torch::kLong && t->is_contiguous() && t->device().is_cpu()
                          && t->size(0) == starts.size(0),
                      "seg_starts, seg_lens and seg_slots must be contiguous int64 CPU tensors of one length [S]");
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  Plan p;
  std::vector<Segment> segments;  // the segments with rows
  for (int64_t s = 0; s < starts.size(0); ++s) {
    TORCH_CHECK_VALUE(start[s] >= 0 && len[s] >= 0 && start[s] <= T - len[s], "segment ", s, " (rows ", start[s],
                      " + ", len[s], ") is not inside the ", T, " rows of x");
    TORCH_CHECK_VALUE(slot[s] >= 0 && slot[s] < L, "segment ", s, " names slot ", slot[s], ", not in [0, ", L, ")");
    if (len[s] > 0) segments.push_back({start[s], len[s], slot[s], 0});
  }
  std::sort(segments.begin(), segments.end(), [](const Segment& a, const Segment& b) {
    return a.start < b.start;
  });
  for (size_t i = 1; i < segments.size(); ++i) {
    const Segment &a = segments[i - 1], &b = segments[i];
    TORCH_CHECK_VALUE(a.start + a.len <= b.start, "segments overlap: rows ", a.start, "..", a.start + a.len, " and ",
                      b.start, "..", b.start + b.len);
  }
  std::stable_sort(segments.begin(), segments.end(), [](const Segment& a, const Segment& b) {
    return a.slot < b.slot;
  });
  for (Segment& seg : segments) {
    seg.h_row = static_cast<int64_t>(p.y_rows.size());
    if (p.groups.empty() || p.groups.back().slot != seg.slot) p.groups.push_back({0, 0, seg.slot, seg.h_row});
    p.groups.back().len += seg.len;
    for (int64_t i = 0; i < seg.len; ++i) p.y_rows.push_back(seg.start + i);
  }
  return p;
}

struct Task {
  int64_t item, m0, m1, c0, c1;  // rows m0 .. m1 of a segment or group; columns c0 .. c1 (of h, or of y)
};

std::vector<Task> split(const std::vector<Segment>& items, int64_t rows_per_task, int64_t cols,
                        int64_t cols_per_task) {
  std::vector<Task> tasks;
  for (int64_t s = 0; s < static_cast<int64_t>(items.size()); ++s)
    for (int64_t m = 0; m < items[s].len; m += rows_per_task)
      for (int64_t c = 0; c < cols; c += cols_per_task)
        tasks.push_back({s, m, std::min(m + rows_per_task, items[s].len), c, std::min(c + cols_per_task, cols)});
  return tasks;
}

template <typename T>
void add_lora_impl(T* y, int64_t ldy, const T* x, int64_t ldx, const T* lora_a, const T* lora_b, const Plan& p,
                   int64_t K, int64_t N, int64_t R) {
  // h [rows, R] fp32, each row zero-padded to whole vectors (ldh floats) for the dot-product path's loads
  const int64_t ldh = (R + LANES - 1) / LANES * LANES;
  std::vector<float> h(p.y_rows.size() * ldh, 0.0f);
  const std::vector<Task> shrinks = split(p.groups, SHRINK_ROWS, R, SHRINK_RANKS);
  tandem_pool::parallel_for(static_cast<int64_t>(shrinks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const Task& task = shrinks[t];
      const Segment& group = p.groups[task.item];
      const int64_t row = group.h_row + task.m0;
      shrink_block(x, ldx, p.y_rows.data() + row, lora_a + group.slot * R * K, task.m1 - task.m0, K, task.c0,
                   task.c1, h.data() + row * ldh, ldh);
    }
  });
  const std::vector<Task> expands = split(p.groups, EXPAND_ROWS, N, NB);
  tandem_pool::parallel_for(static_cast<int64_t>(expands.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const Task& task = expands[t];
      const Segment& group = p.groups[task.item];
      const int64_t row = group.h_row + task.m0;
      expand_block(h.data() + row * ldh, ldh, p.y_rows.data() + row, y, ldy, lora_b + group.slot * N * R,
                   task.m1 - task.m0, R, task.c0, task.c1);
    }
  });
}

}  // namespace

// In place: y [T, N] += the LoRA delta of each segment (see the top of this file). x [T, K], y [T, N] with unit
// column stride; lora_a [L, R, K], lora_b [L, N, R] contiguous; all fp32 or all bf16. ValueError on bad arguments.
void add_lora(torch::Tensor y, torch::Tensor x, torch::Tensor lora_a, torch::Tensor lora_b, torch::Tensor seg_starts,
              torch::Tensor seg_lens, torch::Tensor seg_slots) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK_VALUE(dtype == torch::kFloat || dtype == torch::kBFloat16, "x must be float32 or bfloat16, got ", dtype);
  TORCH_CHECK_VALUE(y.scalar_type() == dtype && lora_a.scalar_type() == dtype && lora_b.scalar_type() == dtype,
                    "y, x, lora_a and lora_b must share one dtype, got ", y.scalar_type(), ", ", dtype, ", ",
                    lora_a.scalar_type(), ", ", lora_b.scalar_type());
  TORCH_CHECK_VALUE(x.device().is_cpu() && y.device().is_cpu() && lora_a.device().is_cpu() && lora_b.device().is_cpu(),
                    "the CPU LoRA kernel takes CPU tensors");
  TORCH_CHECK_VALUE(x.dim() == 2 && y.dim() == 2 && lora_a.dim() == 3 && lora_b.dim() == 3,
                    "x [T, K], y [T, N], lora_a [L, R, K] and lora_b [L, N, R] must be 2-, 2-, 3- and 3-D, got ",
                    x.sizes(), ", ", y.sizes(), ", ", lora_a.sizes(), ", ", lora_b.sizes());
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1), L = lora_a.size(0), R = lora_a.size(1);
  TORCH_CHECK_VALUE(y.size(0) == T && lora_a.size(2) == K && lora_b.size(0) == L && lora_b.size(1) == N &&
                        lora_b.size(2) == R, "x [T, K], y [T, N], lora_a [L, R, K] and lora_b [L, N, R] do not fit: ",
                    x.sizes(), ", ", y.sizes(), ", ", lora_a.sizes(), ", ", lora_b.sizes());
  TORCH_CHECK_VALUE((K <= 1 || x.stride(1) == 1) && (N <= 1 || y.stride(1) == 1),
                    "x and y must have unit column stride");
  TORCH_CHECK_VALUE(lora_a.is_contiguous() && lora_b.is_contiguous(), "lora_a and lora_b must be contiguous");
  const Plan p = plan(seg_starts, seg_lens, seg_slots, T, L);
  if (p.y_rows.empty() || N == 0 || R == 0 || K == 0) return;  // (R or K of 0: a zero delta, y + T(0) == y)
  if (dtype == torch::kFloat) {
    add_lora_impl<float>(y.data_ptr<float>(), y.stride(0), x.data_ptr<float>(), x.stride(0),
                         lora_a.data_ptr<float>(), lora_b.data_ptr<float>(), p, K, N, R);
  } else {
    add_lora_impl<at::BFloat16>(y.data_ptr<at::BFloat16>(), y.stride(0), x.data_ptr<at::BFloat16>(), x.stride(0),
                                lora_a.data_ptr<at::BFloat16>(), lora_b.data_ptr<at::BFloat16>(), p, K, N, R);
  }
}
