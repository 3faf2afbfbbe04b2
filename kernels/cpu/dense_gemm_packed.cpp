// Packed GEMM for many rows of x (prefill chunks, decode batches of PACKED_MIN_ROWS rows or more), bf16 on CPUs with
// AVX512-BF16 and fp32 on CPUs with AVX-512; dense_gemm.cpp calls it from PACKED_MIN_ROWS rows, past its per-row
// path.
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]): x, w, bias and y all bf16 or all fp32; sums in fp32 (bf16's
// products exact), the bias added in fp32, bf16 rounded once (nearest even) at the end.
//
// Why: with many rows the GEMM is bound by arithmetic, and the per-row dot products of dense_gemm.cpp spend part of
// it on horizontal sums and on loading x and w for every product. Here (as oneDNN and BLIS lay out a GEMM) a
// register tile of MR rows x NC columns of fp32 accumulators is updated by one multiply-add per (row, 16 columns, K
// step): the weight's panel of NC columns is repacked so that one zmm holds 16 columns x one K step (a pair of bf16
// for vdpbf16ps, 32 multiply-adds; one fp32 for an FMA, 16), and x's K step is broadcast from memory. No horizontal
// sums.
//
// Packing: per call, per thread, one panel of NC weight rows x KC columns at a time (blocks of 16 x 16 dwords read
// and transposed), into a thread-local buffer that stays in L2 while every row of x passes over it. No second copy
// of the weight is kept. A 16 x 16 transpose (64 shuffles) feeds 16 multiply-adds per row of x, so the repacking is
// a fifth of the time at M = 32 (bf16: 410-450 GFLOP/s on one thread on an earlier host) and vanishes from M = 256
// (530-545, level with oneDNN's bf16 GEMM on one thread; fp32 at M = 256: 196-201 GFLOP/s on 2 threads on the host
// of 2026-12-06, 87% of its FMA rate). While a panel's tiles compute, the panel two ahead is fetched into L2 a few
// lines per K step (Prefetch).
//
// Work: tasks of (one panel, one block of rows) on the kernels' pool (thread_pool.h), panel-major; rows are split
// into blocks only when the panels alone are too few to keep every thread busy.
//
// Summation order (batch invariance): every output element is its own fp32 lane, accumulated over K in order, one
// K step per instruction (vdpbf16ps: acc + the odd product + the even product; fp32: one FMA), K blocks carried in
// fp32; no horizontal sum. That order depends neither on M, nor on the row's place in the batch, nor on the thread
// count: a row gives the same bits alone (through this path) as in any batch. (It differs from dense_gemm.cpp's
// per-row path, which runs below PACKED_MIN_ROWS rows.) vdpbf16ps flushes subnormal inputs and outputs to zero, as
// the per-row bf16 path does.
#include <torch/extension.h>

#include "simd.h"
#include "thread_pool.h"

#include <algorithm>
#include <vector>

#ifdef __AVX512F__
namespace {
using tandem_simd::Prefetch;
using tandem_simd::round_bits;
using bf16 = at::BFloat16;

constexpr int NV = 2;             // 16-column vectors per panel
constexpr int NC = 16 * NV;       // output columns per panel
constexpr int MR = 12;            // rows of x per register tile: MR * NV accumulators + NV weight vectors
constexpr int64_t MC_MAX = 1024;  // rows per task at most: x's block and the fp32 partial sums stay in L2/L3
constexpr int64_t PREFETCH_PANELS = 2;  // panels ahead fetched while one computes (1 and 2 level, 2 a little ahead)

// What differs between the element types. A panel holds dwords: one per (column, K step), where a K step is a pair
// of bf16 (vdpbf16ps' unit) or one fp32; x's K steps are broadcast as dwords the same way.
template <typename T> struct Elem;
#ifdef __AVX512BF16__
template <> struct Elem<bf16> {
  static constexpr int64_t PER_DWORD = 2;
  static constexpr int64_t KC = 2048;  // K per packed block (a multiple of 32): NC * KC bf16 = 128 KB, L2-resident
  static __m512 madd(__m512 acc, __m512i w, __m512i x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
  static void store(bf16* y, __mmask16 mask, __m512 v) {
    _mm256_mask_storeu_epi16(y, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bits(v), 16)));
  }
};
#endif
template <> struct Elem<float> {
  static constexpr int64_t PER_DWORD = 1;
  static constexpr int64_t KC = 1536;  // NC * KC fp32 = 192 KB: the default model's K (576, 1536) in one block
  static __m512 madd(__m512 acc, __m512i w, __m512i x) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(w), _mm512_castsi512_ps(x), acc);
  }
  static void store(float* y, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(y, mask, v); }
};

// 16 vectors of 16 dwords transposed in place: r[j] dword i <- r[i] dword j.
inline void transpose16x16_epi32(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + j], 128-bit lane L: column 4L + j of rows 4i..4i+3
  for (int i = 0; i < 4; ++i) {
    u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // column 4L + j: lane L of u[j], u[4 + j], u[8 + j], u[12 + j] (a 4 x 4 transpose of 128-bit lanes)
  for (int j = 0; j < 4; ++j) {
    const __m512i s0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), s1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
    const __m512i s3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
    r[j] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    r[8 + j] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
}

// panel [kc / E][NC] dwords <- w[n0 + c, k0 + E * p + {0, E - 1}] (E = Elem<T>::PER_DWORD) for the panel's nv
// vectors of columns (rows of w past N: 0).
template <typename T>
void pack_panel(const T* w, int64_t K, int64_t N, int64_t n0, int nv, int64_t k0, int64_t kc, int32_t* panel) {
  constexpr int64_t E = Elem<T>::PER_DWORD, STEP = 16 * E;  // K per 16 x 16 dword block
  for (int v = 0; v < nv; ++v) {
    const int64_t c0 = n0 + 16 * v;
    const int64_t rows = std::min<int64_t>(16, N - c0);
    for (int64_t k = 0; k < kc; k += STEP) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = i < rows ? _mm512_loadu_si512(w + (c0 + i) * K + k0 + k) : _mm512_setzero_si512();
      transpose16x16_epi32(r);  // r[j]: K step k / E + j of the 16 columns
      for (int j = 0; j < 16; ++j) _mm512_store_si512(panel + (k / E + j) * NC + 16 * v, r[j]);
    }
  }
}

template <typename T>
struct Tile {
  const T* x;            // x[m0, k0]; rows K apart
  int64_t K;
  const int32_t* panel;  // the packed block of k0's K steps
  int64_t steps;         // kc / E
  float* partial;        // [R][NC] fp32 sums of the earlier K blocks (read unless first), this one's (written unless
                         // last)
  bool first, last;
  const float* bias;     // [NC] fp32 (0 past N and without a bias)
  T* y;                  // y[m0, n0]; rows N apart
  int64_t N;
  int cols;              // columns of y in this panel (<= 16 * NVU)
};

// The R x (16 * NVU) register tile over one K block; on the last block, y = round(acc + bias).
template <int R, int NVU, typename T>
void tile_kernel(const Tile<T>& t, Prefetch& pf) {
  __m512 acc[R][NVU];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < NVU; ++v)
      acc[i][v] = t.first ? _mm512_setzero_ps() : _mm512_loadu_ps(t.partial + i * NC + 16 * v);
  const int32_t* xr = reinterpret_cast<const int32_t*>(t.x);  // x's K steps as dwords
  const int64_t ldx = t.K / Elem<T>::PER_DWORD;
  const int32_t* wp = t.panel;
  for (int64_t p = 0; p < t.steps; ++p, wp += NC) {
    pf.step(NC * sizeof(int32_t));  // (a later panel at the rate this one is read: it is in by this tile's end)
    __m512i wv[NVU];
    for (int v = 0; v < NVU; ++v) wv[v] = _mm512_load_si512(wp + 16 * v);
    for (int i = 0; i < R; ++i) {
      const __m512i xb = _mm512_set1_epi32(xr[i * ldx + p]);
      for (int v = 0; v < NVU; ++v) acc[i][v] = Elem<T>::madd(acc[i][v], wv[v], xb);
    }
  }
  if (!t.last) {
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < NVU; ++v) _mm512_storeu_ps(t.partial + i * NC + 16 * v, acc[i][v]);
    return;
  }
  for (int v = 0; v < NVU; ++v) {
    const __m512 b = _mm512_loadu_ps(t.bias + 16 * v);
    const int left = t.cols - 16 * v;
    const __mmask16 mask = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    for (int i = 0; i < R; ++i) Elem<T>::store(t.y + i * t.N + 16 * v, mask, _mm512_add_ps(acc[i][v], b));
  }
}

template <int R, int NVU = NV, typename T>
void tile_rows(const Tile<T>& t, int nv, Prefetch& pf) {  // nv <= NV: the vectors of columns in this panel
  if (nv == NVU) return tile_kernel<R, NVU>(t, pf);
  if constexpr (NVU > 1) tile_rows<R, NVU - 1>(t, nv, pf);
}

template <int R = MR, typename T>
void tile_any(const Tile<T>& t, int rows, int nv, Prefetch& pf) {  // rows <= MR
  if (rows == R) return tile_rows<R>(t, nv, pf);
  if constexpr (R > 1) tile_any<R - 1>(t, rows, nv, pf);
}

// y [M, N] = x [M, K] @ w [N, K].T (+ bias [N]); contiguous, K % 32 == 0 (checked by the caller).
template <typename T>
void packed_gemm(const T* x, const T* w, const T* bias, T* y, int64_t M, int64_t K, int64_t N) {
  constexpr int64_t KC = Elem<T>::KC, E = Elem<T>::PER_DWORD;
  const int64_t num_panels = (N + NC - 1) / NC;
  // rows per task: all of them, unless the panels are fewer than 4 per thread (a narrow N) or M is past MC_MAX
  int64_t m_blocks = (M + MC_MAX - 1) / MC_MAX;
  const int64_t want = 4 * tandem_pool::num_threads();
  if (num_panels * m_blocks < want) m_blocks = std::max(m_blocks, (want + num_panels - 1) / num_panels);
  const int64_t mc = ((M + m_blocks - 1) / m_blocks + MR - 1) / MR * MR;
  m_blocks = (M + mc - 1) / mc;
  // NOTE: consecutive panels per claim, so that the panel a thread prefetches is mostly its own next one
  const int64_t num_tasks = num_panels * m_blocks, grain = std::max<int64_t>(1, num_tasks / (2 * want));
  tandem_pool::parallel_for(num_tasks, grain, [&](int64_t begin, int64_t end) {
    // NOTE: thread-local, grown once: a panel block (NC * KC / E dwords) and the partial sums of K > KC
    thread_local std::vector<__m512i> panel_buf, partial_buf;
    if (panel_buf.size() < static_cast<size_t>(NC * KC / E / 16)) panel_buf.resize(NC * KC / E / 16);
    int32_t* panel = reinterpret_cast<int32_t*>(panel_buf.data());
    int64_t packed_n0 = -1;  // the panel in the buffer, when it holds all of K
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n0 = (task / m_blocks) * NC, m0 = (task % m_blocks) * mc, rows = std::min(mc, M - m0);
      const int cols = static_cast<int>(std::min<int64_t>(NC, N - n0)), nv = (cols + 15) / 16;
      alignas(64) float bias_panel[NC] = {};
      if (bias != nullptr)
        for (int c = 0; c < cols; ++c) bias_panel[c] = static_cast<float>(bias[n0 + c]);
      float* partial = nullptr;
      if (K > KC) {
        const size_t need = static_cast<size_t>(rows) * NC * 4 / 64 + 1;
        if (partial_buf.size() < need) partial_buf.resize(need);
        partial = reinterpret_cast<float*>(partial_buf.data());
      }
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        if (n0 != packed_n0) pack_panel(w, K, N, n0, nv, k0, kc, panel);
        packed_n0 = kc == K ? n0 : -1;
        // the panel PREFETCH_PANELS ahead, when it is whole (threads that claim one panel at a time alternate): its
        // NC rows' K block, fetched into L2 while this panel's first tile computes
        const int64_t next_n0 = n0 + PREFETCH_PANELS * NC, row_bytes = K * static_cast<int64_t>(sizeof(T));
        Prefetch pf = m0 == 0 && next_n0 + NC <= N
                          ? Prefetch(w + next_n0 * K + k0, kc * static_cast<int64_t>(sizeof(T)), NC, row_bytes)
                          : Prefetch();
        // tiles of equal rows (+-1): no short last tile, whose few accumulators would wait on the multiply-add's
        // latency
        const int64_t num_tiles = (rows + MR - 1) / MR, base = rows / num_tiles, longer = rows % num_tiles;
        for (int64_t i = 0, m = 0; i < num_tiles; ++i) {
          const int r = static_cast<int>(base + (i < longer));
          const Tile<T> t{x + (m0 + m) * K + k0, K, panel, kc / E, partial + (partial ? m * NC : 0), k0 == 0,
                          k0 + kc == K, bias_panel, y + (m0 + m) * N + n0, N, cols};
          tile_any(t, r, nv, pf);
          m += r;
        }
      }
    }
  });
}

}  // namespace

void dense_gemm_packed(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N) {
  packed_gemm(x, w, bias, y, M, K, N);
}
#else
void dense_gemm_packed(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "the packed fp32 GEMM needs AVX-512 (this build targets a CPU without it)");
}
#endif

#ifdef __AVX512BF16__
void dense_gemm_packed(const bf16* x, const bf16* w, const bf16* bias, bf16* y, int64_t M, int64_t K, int64_t N) {
  packed_gemm(x, w, bias, y, M, K, N);
}

#else  // without AVX512-BF16: dense_gemm.cpp keeps its per-row path

void dense_gemm_packed(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*, at::BFloat16*, int64_t,
                       int64_t, int64_t) {
  TORCH_CHECK(false, "the packed bf16 GEMM needs AVX512-BF16 (this build targets a CPU without it)");
}

#endif

bool dense_gemm_packed_available(bool bf16) {
#if defined(__AVX512BF16__)
  return true;
#elif defined(__AVX512F__)
  return !bf16;
#else
  return false;
#endif
}
