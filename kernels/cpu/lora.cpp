// The batched LoRA delta of a mixed-adapter batch on x86-64 CPUs with AVX2 + FMA or AVX-512: Punica's SGMV
// (Chen et al. 2023, arXiv 2310.18547; S-LoRA, Sheng et al. 2023), a shrink then an expand per segment of rows.
//
// For each segment s (rows start_s .. + len_s of x and y, adapter slot a_s):
//   h [len_s, R] = x[rows] @ lora_a[a_s].T        (shrink: fp32 products and sums, h kept in fp32)
//   y[rows]     += T(h @ lora_b[a_s].T)            (expand: fp32, the delta rounded once to y's type T, then added
//                                                   in T: y = T(y + T(delta)), as kernels/lora.py add_lora_ref does)
// T is fp32 or bf16 (widened to fp32 in registers: exact). Rows in no segment are not touched.
//
// Two phases, each one parallel_for on the kernels' thread pool (thread_pool.h):
// - shrink: tasks of (segment, up to SHRINK_ROWS rows, up to SHRINK_RANKS rows of lora_a); register tiles of
//   SHRINK_MT rows of x by SHRINK_NT rows of lora_a, dot products over K (K is long: one horizontal sum per K).
// - expand: tasks of (segment, up to EXPAND_ROWS rows, up to NB columns of y). The inner dimension is the rank (1 to
//   a few dozen), too short for a dot product per output, so a row block of at least PACK_MIN_ROWS rows packs its
//   NB x R slice of lora_b transposed into fp32 (R x NB, per task: 1 / rows of the work) and accumulates outer
//   products, EXPAND_MT rows by EXPAND_NV vectors of columns, no horizontal sums. A decode segment (1 row, or a
//   few: below PACK_MIN_ROWS) would pay as much to pack as to multiply, so it takes dot products over R instead.
// Decode (many 1-row segments: a BGMV) spreads over segments x column blocks; a prefill segment (hundreds of rows)
// over row blocks x column blocks.
//
// Any K, N and R: the SIMD loops end with scalar tails. Layouts: x [T, K] and y [T, N] with unit column stride (any
// row stride: y may be a column slice of a fused output), lora_a [L, R, K] and lora_b [L, N, R] contiguous,
// seg_starts / seg_lens / seg_slots int64 [S] contiguous. Segments must lie inside [0, T), not overlap, and name a
// slot in [0, L): ValueError otherwise (checked here, before any work).
#include <torch/extension.h>

#include "simd.h"
#include "thread_pool.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace {
using namespace tandem_simd;

struct Segment {
  int64_t start, len, slot;
  int64_t h_row;  // its first row in h (h holds the segments' rows back to back)
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

// h[i * ldh + j] for i < ROWS, j < ranks (<= SHRINK_NT); a: the first of those rows of lora_a (absent rows read
// it again and are not stored).
template <int ROWS, typename T>
inline void shrink_tile(const T* x, int64_t ldx, const T* a, int64_t K, int ranks, float* h, int64_t ldh) {
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
      const V xv = load_f32(x + i * ldx + k);
      for (int j = 0; j < SHRINK_NT; ++j) acc[j][i] = vfmadd(av[j], xv, acc[j][i]);
    }
  }
  for (int j = 0; j < ranks; ++j) {
    for (int i = 0; i < ROWS; ++i) {
      float sum = k_vec > 0 ? hsum(acc[j][i]) : 0.0f;
      for (int64_t k = k_vec; k < K; ++k) sum += to_f32(x[i * ldx + k]) * to_f32(ar[j][k]);
      h[i * ldh + j] = sum;
    }
  }
}

template <int ROWS, typename T>
inline void shrink_rows_left(const T* x, int64_t ldx, const T* a, int64_t K, int ranks, float* h, int64_t ldh,
                             int64_t rows) {
  if constexpr (ROWS > 0) {
    if (rows == ROWS) return shrink_tile<ROWS>(x, ldx, a, K, ranks, h, ldh);
    shrink_rows_left<ROWS - 1>(x, ldx, a, K, ranks, h, ldh, rows);
  }
}

// h [M, R] columns r0 .. r1 (rows ldh floats apart) of M rows of x, against a = lora_a[slot] [R, K].
template <typename T>
void shrink_block(const T* x, int64_t ldx, const T* a, int64_t M, int64_t K, int64_t r0, int64_t r1, float* h,
                  int64_t ldh) {
  for (int64_t r = r0; r < r1; r += SHRINK_NT) {
    const int ranks = static_cast<int>(std::min<int64_t>(SHRINK_NT, r1 - r));
    int64_t m = 0;
    for (; m + SHRINK_MT <= M; m += SHRINK_MT)
      shrink_tile<SHRINK_MT>(x + m * ldx, ldx, a + r * K, K, ranks, h + m * ldh + r, ldh);
    shrink_rows_left<SHRINK_MT - 1>(x + m * ldx, ldx, a + r * K, K, ranks, h + m * ldh + r, ldh, M - m);
  }
}

// ---- expand: y[m, n] += T(sum_r h[m, r] * b[n, r]) ---------------------------------------------------------------

constexpr int64_t NB = 256;                       // columns of y per task
constexpr int64_t EXPAND_ROWS = 256;              // rows per task (the packed path packs once per task)
constexpr int64_t PACK_MIN_ROWS = 8;              // rows of a task from which it packs lora_b (else dot products)
constexpr int EXPAND_MT = LANES == 16 ? 6 : 4;    // rows per register tile of the packed path
constexpr int EXPAND_NV = LANES == 16 ? 4 : 2;    // vectors of columns per register tile: MT * NV + NV + 1 vectors
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
// b: lora_b's row of the first column (absent columns read it again and are not stored).
template <typename T>
inline void expand_dot(const float* h, int64_t R, const T* b, int64_t cols, T* y) {
  const T* br[LANES];
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
  for (int64_t r = 0; r < R; ++r) {
    float* row = bt + r * BT_STRIDE;
    for (int64_t j = 0; j < cols; ++j) row[j] = to_f32(b[j * R + r]);
    std::fill(row + cols, row + width, 0.0f);
  }
}

// Packed path: y[i, c] for i < ROWS, c < cols (<= COLS), from bt's columns (COLS of them, zero past cols).
template <int ROWS, typename T>
inline void expand_packed_tile(const float* h, int64_t ldh, int64_t R, const float* bt, int64_t cols, T* y,
                               int64_t ldy) {
  V acc[ROWS][EXPAND_NV];
  for (int i = 0; i < ROWS; ++i)
    for (int v = 0; v < EXPAND_NV; ++v) acc[i][v] = vzero();
  for (int64_t r = 0; r < R; ++r) {
    V bv[EXPAND_NV];
    for (int v = 0; v < EXPAND_NV; ++v) bv[v] = vload(bt + r * BT_STRIDE + v * LANES);
    for (int i = 0; i < ROWS; ++i) {
      const V hv = vbroadcast(h + i * ldh + r);
      for (int v = 0; v < EXPAND_NV; ++v) acc[i][v] = vfmadd(hv, bv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < ROWS; ++i)
    for (int v = 0; v < EXPAND_NV && v * LANES < cols; ++v)
      add_deltas(y + i * ldy + v * LANES, acc[i][v], std::min<int64_t>(LANES, cols - v * LANES));
}

template <int ROWS, typename T>
inline void expand_packed_rows(const float* h, int64_t ldh, int64_t R, const float* bt, int64_t cols, T* y,
                               int64_t ldy, int64_t rows) {
  if constexpr (ROWS > 0) {
    if (rows == ROWS) return expand_packed_tile<ROWS>(h, ldh, R, bt, cols, y, ldy);
    expand_packed_rows<ROWS - 1>(h, ldh, R, bt, cols, y, ldy, rows);
  }
}

// y [M, N] columns n0 .. n1 += T(h [M, R] @ b.T), b = lora_b[slot] [N, R]; h's rows ldh floats apart.
template <typename T>
void expand_block(const float* h, int64_t ldh, const T* b, int64_t M, int64_t R, int64_t n0, int64_t n1, T* y,
                  int64_t ldy) {
  if (M < PACK_MIN_ROWS) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = n0; n < n1; n += LANES)
        expand_dot(h + m * ldh, R, b + n * R, std::min<int64_t>(LANES, n1 - n), y + m * ldy + n);
    return;
  }
  thread_local std::vector<float> bt;  // [R, BT_STRIDE]
  if (static_cast<int64_t>(bt.size()) < R * BT_STRIDE) bt.resize(R * BT_STRIDE);
  const int64_t width = (n1 - n0 + COLS - 1) / COLS * COLS;
  pack_transposed(b + n0 * R, R, n1 - n0, width, bt.data());
  for (int64_t c = 0; c < width; c += COLS) {
    const int64_t cols = std::min<int64_t>(COLS, n1 - n0 - c);
    int64_t m = 0;
    for (; m + EXPAND_MT <= M; m += EXPAND_MT)
      expand_packed_tile<EXPAND_MT>(h + m * ldh, ldh, R, bt.data() + c, cols, y + m * ldy + n0 + c, ldy);
    expand_packed_rows<EXPAND_MT - 1>(h + m * ldh, ldh, R, bt.data() + c, cols, y + m * ldy + n0 + c, ldy, M - m);
  }
}

// ---- the two phases ---------------------------------------------------------------------------------------------

struct Task {
  int64_t segment, m0, m1, c0, c1;  // rows m0 .. m1 of the segment; columns c0 .. c1 (of h, or of y)
};

std::vector<Task> split(const std::vector<Segment>& segments, int64_t rows_per_task, int64_t cols,
                        int64_t cols_per_task) {
  std::vector<Task> tasks;
  for (int64_t s = 0; s < static_cast<int64_t>(segments.size()); ++s)
    for (int64_t m = 0; m < segments[s].len; m += rows_per_task)
      for (int64_t c = 0; c < cols; c += cols_per_task)
        tasks.push_back({s, m, std::min(m + rows_per_task, segments[s].len), c, std::min(c + cols_per_task, cols)});
  return tasks;
}

template <typename T>
void add_lora_impl(T* y, int64_t ldy, const T* x, int64_t ldx, const T* lora_a, const T* lora_b,
                   const std::vector<Segment>& segments, int64_t h_rows, int64_t K, int64_t N, int64_t R) {
  // h [h_rows, R] fp32, each row zero-padded to whole vectors (ldh floats) for the dot-product path's loads
  const int64_t ldh = (R + LANES - 1) / LANES * LANES;
  std::vector<float> h(h_rows * ldh, 0.0f);
  const std::vector<Task> shrinks = split(segments, SHRINK_ROWS, R, SHRINK_RANKS);
  tandem_pool::parallel_for(static_cast<int64_t>(shrinks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const Task& task = shrinks[t];
      const Segment& seg = segments[task.segment];
      shrink_block(x + (seg.start + task.m0) * ldx, ldx, lora_a + seg.slot * R * K, task.m1 - task.m0, K, task.c0,
                   task.c1, h.data() + (seg.h_row + task.m0) * ldh, ldh);
    }
  });
  const std::vector<Task> expands = split(segments, EXPAND_ROWS, N, NB);
  tandem_pool::parallel_for(static_cast<int64_t>(expands.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const Task& task = expands[t];
      const Segment& seg = segments[task.segment];
      expand_block(h.data() + (seg.h_row + task.m0) * ldh, ldh, lora_b + seg.slot * N * R, task.m1 - task.m0, R,
                   task.c0, task.c1, y + (seg.start + task.m0) * ldy, ldy);
    }
  });
}

// The segments of rows, checked (ValueError): inside [0, T), not overlapping, slots in [0, L); empty ones dropped.
std::vector<Segment> read_segments(const torch::Tensor& starts, const torch::Tensor& lens, const torch::Tensor& slots,
                                   int64_t T, int64_t L, int64_t& h_rows) {
  for (const auto* t : {&starts, &lens, &slots})
    TORCH_CHECK_VALUE(t->dim() == 1 && t->scalar_type() == torch::kLong && t->is_contiguous() && t->device().is_cpu()
                          && t->size(0) == starts.size(0),
                      "seg_starts, seg_lens and seg_slots must be contiguous int64 CPU tensors of one length [S]");
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  std::vector<Segment> segments;
  h_rows = 0;
  for (int64_t s = 0; s < starts.size(0); ++s) {
    TORCH_CHECK_VALUE(start[s] >= 0 && len[s] >= 0 && start[s] <= T - len[s], "segment ", s, " (rows ", start[s],
                      " + ", len[s], ") is not inside the ", T, " rows of x");
    TORCH_CHECK_VALUE(slot[s] >= 0 && slot[s] < L, "segment ", s, " names slot ", slot[s], ", not in [0, ", L, ")");
    if (len[s] == 0) continue;
    segments.push_back({start[s], len[s], slot[s], h_rows});
    h_rows += len[s];
  }
  std::vector<std::pair<int64_t, int64_t>> spans;  // (start, end) in row order
  for (const Segment& seg : segments) spans.emplace_back(seg.start, seg.start + seg.len);
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    TORCH_CHECK_VALUE(spans[i - 1].second <= spans[i].first, "segments overlap: rows ", spans[i - 1].first, "..",
                      spans[i - 1].second, " and ", spans[i].first, "..", spans[i].second);
  return segments;
}

}  // namespace

// In place: y [T, N] += the LoRA delta of each segment (see the top of this file). x [T, K], y [T, N] with unit
// column stride; lora_a [L, R, K], lora_b [L, N, R] contiguous; all fp32 or all bf16. ValueError on bad arguments.
void add_lora(torch::Tensor y, torch::Tensor x, torch::Tensor lora_a, torch::Tensor lora_b, torch::Tensor seg_starts,
              torch::Tensor seg_lens, torch::Tensor seg_slots) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK_VALUE(dtype == torch::kFloat || dtype == torch::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK_VALUE(y.scalar_type() == dtype && lora_a.scalar_type() == dtype && lora_b.scalar_type() == dtype,
                    "y, x, lora_a and lora_b must share one dtype");
  TORCH_CHECK_VALUE(x.device().is_cpu() && y.device().is_cpu() && lora_a.device().is_cpu() && lora_b.device().is_cpu(),
                    "the CPU LoRA kernel takes CPU tensors");
  TORCH_CHECK_VALUE(x.dim() == 2 && y.dim() == 2 && lora_a.dim() == 3 && lora_b.dim() == 3,
                    "x [T, K], y [T, N], lora_a [L, R, K] and lora_b [L, N, R]");
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1), L = lora_a.size(0), R = lora_a.size(1);
  TORCH_CHECK_VALUE(y.size(0) == T && lora_a.size(2) == K && lora_b.size(0) == L && lora_b.size(1) == N &&
                        lora_b.size(2) == R, "x [T, K], y [T, N], lora_a [L, R, K] and lora_b [L, N, R]");
  TORCH_CHECK_VALUE((K <= 1 || x.stride(1) == 1) && (N <= 1 || y.stride(1) == 1),
                    "x and y must have unit column stride");
  TORCH_CHECK_VALUE(lora_a.is_contiguous() && lora_b.is_contiguous(), "lora_a and lora_b must be contiguous");
  int64_t h_rows = 0;
  const std::vector<Segment> segments = read_segments(seg_starts, seg_lens, seg_slots, T, L, h_rows);
  if (h_rows == 0 || N == 0) return;
  if (R == 0 || K == 0) return;  // (a zero delta: y + T(0) == y)
  if (dtype == torch::kFloat) {
    add_lora_impl<float>(y.data_ptr<float>(), y.stride(0), x.data_ptr<float>(), x.stride(0),
                         lora_a.data_ptr<float>(), lora_b.data_ptr<float>(), segments, h_rows, K, N, R);
  } else {
    add_lora_impl<at::BFloat16>(y.data_ptr<at::BFloat16>(), y.stride(0), x.data_ptr<at::BFloat16>(), x.stride(0),
                                lora_a.data_ptr<at::BFloat16>(), lora_b.data_ptr<at::BFloat16>(), segments, h_rows,
                                K, N, R);
  }
}
