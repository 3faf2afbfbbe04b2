// Packed bf16 GEMM for many rows of x (prefill chunks, decode batches of 6 rows or more) on CPUs with
// AVX512-BF16; dense_gemm.cpp calls it from PACKED_MIN_ROWS rows, past its per-row path.
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]): x, w, bias and y bf16; products exact, sums in fp32, the bias added
// in fp32, one rounding to bf16 (nearest even) at the end.
//
// Why: with many rows the GEMM is bound by arithmetic, and the per-row dot products of dense_gemm.cpp spend part of
// it on horizontal sums and on loading x and w for every product. Here (as oneDNN and BLIS lay out a GEMM) a
// register tile of MR rows x NC columns of fp32 accumulators is updated by one vdpbf16ps per (row, 16 columns, pair
// of K): the weight's panel of NC columns is repacked so that one zmm holds 16 columns x one pair of K, and x's
// pair is broadcast from memory. No horizontal sums; per instruction, 32 multiply-adds.
//
// Packing: per call, per thread, one panel of NC weight rows x KC columns at a time (16 x 32 bf16 blocks read as
// 16 x 16 dwords and transposed), into a thread-local buffer that stays in L2 while every row of x passes over it.
// No second copy of the weight is kept. A 16 x 16 transpose (64 shuffles) feeds 16 vdpbf16ps per row of x, so
// the repacking is a fifth of the time at M = 32 (410-450 GFLOP/s on one thread here) and vanishes from M = 256
// (530-545, level with oneDNN's bf16 GEMM on one thread).
//
// Work: tasks of (one panel, one block of rows) on the kernels' pool (thread_pool.h), panel-major; rows are split
// into blocks only when the panels alone are too few to keep every thread busy.
//
// Summation order (batch invariance): every output element is its own fp32 lane, accumulated over K in order, one
// pair per instruction (vdpbf16ps: acc + the odd product + the even product), K blocks carried in fp32; no
// horizontal sum. That order depends neither on M, nor on the row's place in the batch, nor on the thread count:
// a row gives the same bits alone (through this path) as in any batch. (It differs from dense_gemm.cpp's per-row
// path, which runs below PACKED_MIN_ROWS rows.) vdpbf16ps flushes subnormal inputs and outputs to zero, as the
// per-row bf16 path does.
#include <torch/extension.h>

#include "simd.h"
#include "thread_pool.h"

#include <algorithm>
#include <vector>

#ifdef __AVX512BF16__
namespace {
using tandem_simd::round_bits;
using bf16 = at::BFloat16;

constexpr int NV = 2;             // 16-column vectors per panel
constexpr int NC = 16 * NV;       // output columns per panel
constexpr int MR = 12;            // rows of x per register tile: MR * NV accumulators + NV weight vectors
constexpr int64_t KC = 2048;      // K per packed block (a multiple of 32): NC * KC bf16 = 128 KB, L2-resident
constexpr int64_t MC_MAX = 1024;  // rows per task at most: x's block and the fp32 partial sums stay in L2/L3

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

// panel [kc / 2][NC][2] <- w[n0 + c, k0 + 2p + {0, 1}] for the panel's nv vectors of columns (rows of w past N: 0);
// the same columns of the next panel's rows are prefetched (a weight that streams from memory: the LM head's).
void pack_panel(const bf16* w, int64_t K, int64_t N, int64_t n0, int nv, int64_t k0, int64_t kc, bf16* panel) {
  for (int v = 0; v < nv; ++v) {
    const int64_t c0 = n0 + 16 * v;
    const int64_t rows = std::min<int64_t>(16, N - c0);
    const bool prefetch = c0 + NC + 16 <= N;
    for (int64_t k = 0; k < kc; k += 32) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + (c0 + NC + i) * K + k0 + k), _MM_HINT_T0);
        r[i] = i < rows ? _mm512_loadu_si512(w + (c0 + i) * K + k0 + k) : _mm512_setzero_si512();
      }
      transpose16x16_epi32(r);  // r[j]: pair k / 2 + j of the 16 columns
      for (int j = 0; j < 16; ++j) _mm512_store_si512(panel + ((k / 2 + j) * NC + 16 * v) * 2, r[j]);
    }
  }
}

struct Tile {
  const bf16* x;     // x[m0, k0]; rows K apart
  int64_t K;
  const bf16* panel; // the packed block of k0's pairs
  int64_t pairs;     // kc / 2
  float* partial;    // [R][NC] fp32 sums of the earlier K blocks (read unless first), this one's (written unless last)
  bool first, last;
  const float* bias; // [NC] fp32 (0 past N and without a bias)
  bf16* y;           // y[m0, n0]; rows N apart
  int64_t N;
  int cols;          // columns of y in this panel (<= 16 * NVU)
};

// The R x (16 * NVU) register tile over one K block; on the last block, y = round(acc + bias).
template <int R, int NVU>
void tile_kernel(const Tile& t) {
  __m512 acc[R][NVU];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < NVU; ++v)
      acc[i][v] = t.first ? _mm512_setzero_ps() : _mm512_loadu_ps(t.partial + i * NC + 16 * v);
  const int32_t* xr = reinterpret_cast<const int32_t*>(t.x);  // x's pairs as dwords
  const int64_t ldx = t.K / 2;
  const bf16* wp = t.panel;
  for (int64_t p = 0; p < t.pairs; ++p, wp += 2 * NC) {
    __m512bh wv[NVU];
    for (int v = 0; v < NVU; ++v) wv[v] = (__m512bh)_mm512_load_si512(wp + 32 * v);
    for (int i = 0; i < R; ++i) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xr[i * ldx + p]);
      for (int v = 0; v < NVU; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], wv[v], xb);
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
    for (int i = 0; i < R; ++i) {
      const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bits(_mm512_add_ps(acc[i][v], b)), 16));
      _mm256_mask_storeu_epi16(t.y + i * t.N + 16 * v, mask, h);
    }
  }
}

template <int R, int NVU = NV>
void tile_rows(const Tile& t, int nv) {  // nv <= NV: the vectors of columns in this panel
  if (nv == NVU) return tile_kernel<R, NVU>(t);
  if constexpr (NVU > 1) tile_rows<R, NVU - 1>(t, nv);
}

template <int R = MR>
void tile_any(const Tile& t, int rows, int nv) {  // rows <= MR
  if (rows == R) return tile_rows<R>(t, nv);
  if constexpr (R > 1) tile_any<R - 1>(t, rows, nv);
}

}  // namespace

bool dense_gemm_packed_available() { return true; }

// y [M, N] = x [M, K] @ w [N, K].T (+ bias [N]); all bf16, contiguous, K % 32 == 0 (checked by the caller).
void dense_gemm_packed(const bf16* x, const bf16* w, const bf16* bias, bf16* y, int64_t M, int64_t K, int64_t N) {
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
    // NOTE: thread-local, grown once: a panel block (NC * KC bf16) and the partial sums of K > KC
    thread_local std::vector<__m512i> panel_buf, partial_buf;
    if (panel_buf.empty()) panel_buf.resize(NC * KC * 2 / 64);
    bf16* panel = reinterpret_cast<bf16*>(panel_buf.data());
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
        // tiles of equal rows (+-1): no short last tile, whose few accumulators would wait on vdpbf16ps' latency
        const int64_t num_tiles = (rows + MR - 1) / MR, base = rows / num_tiles, longer = rows % num_tiles;
        for (int64_t i = 0, m = 0; i < num_tiles; ++i) {
          const int r = static_cast<int>(base + (i < longer));
          const Tile t{x + (m0 + m) * K + k0, K, panel, kc / 2, partial + (partial ? m * NC : 0), k0 == 0,
                       k0 + kc == K, bias_panel, y + (m0 + m) * N + n0, N, cols};
          tile_any(t, r, nv);
          m += r;
        }
      }
    }
  });
}

#else  // without AVX512-BF16: dense_gemm.cpp keeps its per-row path

bool dense_gemm_packed_available() { return false; }
void dense_gemm_packed(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*, at::BFloat16*, int64_t,
                       int64_t, int64_t) {
  TORCH_CHECK(false, "the packed bf16 GEMM needs AVX512-BF16 (this build targets a CPU without it)");
}

#endif
