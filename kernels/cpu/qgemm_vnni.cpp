// Quantized GEMM on integer dot products for AVX-512 VNNI CPUs: int4 or int8 weights times activations quantized
// to int16 on the fly, int32 sums, fp32 scales.
//
// y[m, n] = sum_k w[n, k] * x~[m, k], where
// - w[n, k] = s[n, g] * (c[n, k] - z[n, g]), codes c (int4: 0..15 with a zero point z; int8: -128..127, z = 0),
//   g = k / G;
// - x~[m, k] = dx[m, b] * qx[m, k], the activations quantized per row and block b of 32 columns:
//   dx = max|x| / 32767, qx = round-half-even(x * (32767 / max|x|)) (a block with max|x| < 2^-100 counts as 0).
//   Its relative error (2^-16 of the block's largest value) is far below fp32 GEMM's own rounding differences on
//   the model's outputs: int8 activations (llama.cpp's Q8_0) cost this model 0.003 KL and 3% top-1 agreement
//   against its weights in fp32, int16 nothing measurable (docs/performance.md).
// So y[m, n] = sum_b s[n, g(b)] * dx[m, b] * D[m, n, b] - sum_b zs[n, g(b)] * X[m, b], with D the block's
// exact int32 dot product of codes and qx (vpdpwssd: 32 int16 multiply-adds, pairs summed into 16 int32 lanes),
// zs = z * s and X[m, b] = dx[m, b] * sum of qx over the block.
//
// Why: the fp32-activation kernel (qgemm.cpp) widens every code to fp32 before an FMA, which made it bound by
// instructions, not bytes, at M = 1, and a prefill chunk ran at fp32 GEMM speed. Here codes are widened only to
// int16 (int4: masked out of their nibbles) and one instruction does 32 multiply-adds. Every output element adds
// its blocks' terms in block order whatever M, the tiling or the thread count: a row's result does not depend on
// what it is batched with.
//
// Weight layout (made once per layer by kernels/cpu_qgemm.py pack_vnni): rows in tiles of 16 (one int32 lane per
// row; N padded with zero rows), then blocks of 32 columns. In a block of a tile, pair p (columns 32 b + 2 p and
// + 1) of the 16 rows is 32 codes, row r at positions 2 r and 2 r + 1: int8 stores the 16 pairs as 16 x 32 bytes;
// int4 stores pairs p and p + 8 in the low and high nibbles of 32 bytes, 8 x 32 bytes.
// Scales and zs: fp32 [tiles, num_groups, 16].
//
// Two paths over this layout, giving the same bits: the tile path (rows_over_tiles: tile_kernel on 1-4 tiles x up
// to 8 rows) and, for 3 to 255 rows, the panel path (gemm_panels: register tiles of 3 int4 / 4 int8 weight tiles x
// 4 / 3 rows, 12 int32 chains, each broadcast of activations feeding 3-4 vpdpwssd).
// What bounds both at many rows, on AMD Zen 4 (benchmarks/cpu_pipes.py): a zmm vpdpwssd, and the fold's vmulps,
// vfmadd and vfnmadd, share the two 256-bit multiply pipes, one zmm instruction per cycle; the nibble masks, the
// widening, the cvt and the broadcasts issue beside them. Per row, 16 output rows and block of 32 columns: 16
// vpdpwssd and 3 fold products (int8: 2), so at most 16 / 19 = 84% of vpdpwssd's 64 FLOP per cycle, about 194
// GFLOP/s per core at 3.6 GHz (int8: 89%). Both paths are near it on one thread (benchmarks/cpu_qgemm.py, medians
// of alternating turns, tile / panel path, GFLOP/s):
//   M = 10: 156-171 / 162-178 (int4, 1.04-1.05x), LM head int8 100 / 114 (1.14x);
//   M = 32-64: 171-182 / 175-184 (1.01-1.03x); M = 256-512: 174-182 / 169-184 (0.94x for gate_up at 512,
//   1.01-1.02x for the others), so the tile path keeps M >= 256. On 2 threads, 3-9 rows (the rows of a decode
//   step at batch 3-9): panels 1.00-1.20x at M = 3, 1.01-1.68x from 5 (the LM head most), 0.93-0.99x at M = 2
//   but the LM head's 1.17x, so the panel path starts at 3 rows (it started at 10 before).
// The packed bf16 GEMM on the same shapes ran at 182-219 (vdpbf16ps has the same rate and no fold): the integer
// path is 0.81-0.92x of it from M = 64 and 1.25-1.8x at M = 10. Fewer fold products per block would change the
// arithmetic (the scales of a Q4_1 weight change every block of 32), so the bits.
#include <torch/extension.h>

#include "simd.h"
#include "thread_pool.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TANDEM_HAS_VNNI 1
#endif

namespace {
using tandem_simd::Prefetch;

constexpr int TILE = 16;   // output rows per tile: one int32 lane each
constexpr int BLOCK = 32;  // columns per activation block
// the panel path (below) for PANEL_MIN_ROWS <= M < PANEL_MAX_ROWS, the tile path otherwise (where each was faster:
// benchmarks/cpu_qgemm.py, docs/performance.md)
constexpr int64_t PANEL_MIN_ROWS = 3, PANEL_MAX_ROWS = 256;
constexpr int PANEL_TILES_INT4 = 3, PANEL_ROWS_INT4 = 4;  // NT x MR of the panel path's register tiles
constexpr int PANEL_TILES_INT8 = 4, PANEL_ROWS_INT8 = 3;
// tasks ahead whose tiles a task fetches (Prefetch): a decode step's integer linears at 8 rows took 10.6 ms a pass
// at 2, 10.7 at 1, 13.9 at 4, 14.3 without (python -m tandem.benchmarks.cpu_qgemm --step-rows)
constexpr int64_t PREFETCH_TASKS = 2;

#ifdef TANDEM_HAS_VNNI

constexpr float QMAX = 32767.0f;
constexpr float MIN_AMAX = 0x1p-100f;  // blocks whose largest |x| is smaller count as zero

// x [M, K] fp32 -> qx [M, K] int16, dx and xsum [M, K / 32] fp32 (xsum = dx * sum of the block's qx).
void quantize_rows(const float* x, int64_t M, int64_t K, int16_t* qx, float* dx, float* xsum) {
  const int64_t nb = K / BLOCK;
  tandem_pool::parallel_for(M, 16, [&](int64_t begin, int64_t end) {
    const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* p = x + m * K + b * BLOCK;
        const __m512 a0 = _mm512_loadu_ps(p), a1 = _mm512_loadu_ps(p + 16);
        const float amax = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_and_ps(a0, sign_off), _mm512_and_ps(a1, sign_off)));
        int16_t* q = qx + m * K + b * BLOCK;
        // NaN in the block (max drops NaN lanes, so look for them) or an infinity: the block's scale is NaN, so
        // every output of the row is NaN, as a float GEMM's would be non-finite (the engine aborts such a request)
        const bool nan = (_mm512_cmp_ps_mask(a0, a0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(a1, a1, _CMP_UNORD_Q)) != 0;
        // A block below MIN_AMAX counts as zero (32767 / amax would overflow below about 1e-34).
        if (amax < MIN_AMAX || nan || amax == std::numeric_limits<float>::infinity()) {
          std::memset(q, 0, BLOCK * sizeof(int16_t));
          dx[m * nb + b] = xsum[m * nb + b] = amax < MIN_AMAX && !nan ? 0.0f : std::numeric_limits<float>::quiet_NaN();
          continue;
        }
        const __m512 inv = _mm512_set1_ps(QMAX / amax);
        const __m512i lo = _mm512_set1_epi32(-32767), hi = _mm512_set1_epi32(32767);
        // (round to nearest even: the default MXCSR mode, as torch.round)
        const __m512i q0 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a0, inv)), lo), hi);
        const __m512i q1 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a1, inv)), lo), hi);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtsepi32_epi16(q0));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), _mm512_cvtsepi32_epi16(q1));
        const float d = amax / QMAX;
        dx[m * nb + b] = d;
        xsum[m * nb + b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
      }
    }
  });
}

struct Packed {
  const uint8_t* codes;  // [tiles, nb, 8 (int4) or 16 (int8), 32]
  const float* scales;   // [tiles, num_groups, 16]
  const float* zs;       // [tiles, num_groups, 16]
  int64_t nb, num_groups, blocks_per_group, N;
};

struct Acts {
  const int16_t* qx;
  const float* dx;
  const float* xsum;
  int64_t K, nb;
};

// 2 int16 activations in every int32 lane.
inline __m512i broadcast_pair(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Tiles [t0, t0 + nt) of a later task, fetched into L2 while this one computes (simd.h's Prefetch): their codes
// (contiguous: nt * nb blocks), scales and zero points, stepped once per block at the rate this task reads its own.
struct TilesAhead {
  Prefetch codes, scales, zs;
  int64_t codes_step = 0, scales_step = 0;
  inline void step() {
    codes.step(codes_step);
    scales.step(scales_step);
    zs.step(scales_step);
  }
};

// The tiles `ahead` tasks of nt tiles later (a thread's next task, where claims alternate between threads), within
// the weight's tiles; none past them.
inline TilesAhead prefetch_ahead(const Packed& w, int64_t t0, int64_t nt, int64_t ahead, int loads) {
  const int64_t tiles = (w.N + TILE - 1) / TILE, ta = t0 + ahead * nt;
  if (ta + nt > tiles) return TilesAhead{};
  const int64_t block_bytes = static_cast<int64_t>(loads) * 32, scale_bytes = nt * w.num_groups * TILE * 4;
  return TilesAhead{Prefetch(w.codes + ta * w.nb * block_bytes, nt * w.nb * block_bytes),
                    Prefetch(w.scales + ta * w.num_groups * TILE, scale_bytes),
                    Prefetch(w.zs + ta * w.num_groups * TILE, scale_bytes), nt * block_bytes,
                    (scale_bytes + w.nb - 1) / w.nb};
}

// y rows [m0, m0 + MT) x tiles [t0, t0 + NTL): NTL * MT int32 accumulators per block, folded into fp32 ones.
template <bool INT4, int NTL, int MT>
void tile_kernel(const Packed& w, const Acts& a, int64_t t0, int64_t m0, float* y, TilesAhead pf) {
  constexpr int LOADS = INT4 ? 8 : 16;  // 32-byte loads per block of a tile
  const __m512i nibble = _mm512_set1_epi16(0x0F);
  __m512 f[NTL][MT];
  for (int t = 0; t < NTL; ++t)
    for (int i = 0; i < MT; ++i) f[t][i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.nb; ++b) {
    pf.step();
    __m512i acc[NTL][MT];
    for (int t = 0; t < NTL; ++t)
      for (int i = 0; i < MT; ++i) acc[t][i] = _mm512_setzero_si512();
    const int16_t* xb = a.qx + m0 * a.K + b * BLOCK;
    for (int p = 0; p < LOADS; ++p) {
      for (int t = 0; t < NTL; ++t) {
        const __m256i bytes =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.codes + (((t0 + t) * w.nb + b) * LOADS + p) * 32));
        if constexpr (INT4) {
          const __m512i words = _mm512_cvtepu8_epi16(bytes);
          const __m512i low = _mm512_and_si512(words, nibble), high = _mm512_srli_epi16(words, 4);
          for (int i = 0; i < MT; ++i) {
            acc[t][i] = _mm512_dpwssd_epi32(acc[t][i], low, broadcast_pair(xb + i * a.K + 2 * p));
            acc[t][i] = _mm512_dpwssd_epi32(acc[t][i], high, broadcast_pair(xb + i * a.K + 2 * (p + 8)));
          }
        } else {
          const __m512i words = _mm512_cvtepi8_epi16(bytes);
          for (int i = 0; i < MT; ++i)
            acc[t][i] = _mm512_dpwssd_epi32(acc[t][i], words, broadcast_pair(xb + i * a.K + 2 * p));
        }
      }
    }
    const int64_t g = b / w.blocks_per_group;
    for (int t = 0; t < NTL; ++t) {
      const __m512 s = _mm512_loadu_ps(w.scales + ((t0 + t) * w.num_groups + g) * TILE);
      const __m512 zs = _mm512_loadu_ps(w.zs + ((t0 + t) * w.num_groups + g) * TILE);
      for (int i = 0; i < MT; ++i) {
        const int64_t mb = (m0 + i) * a.nb + b;
        const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(a.dx[mb]));
        f[t][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t][i]), sd, f[t][i]);
        // (int8 has no zero point: skipping it also keeps 0 * an overflowed sum from making a NaN)
        if constexpr (INT4) f[t][i] = _mm512_fnmadd_ps(zs, _mm512_set1_ps(a.xsum[mb]), f[t][i]);
      }
    }
  }
  for (int t = 0; t < NTL; ++t) {
    const int64_t n0 = (t0 + t) * TILE;
    const int rows = static_cast<int>(std::min<int64_t>(TILE, w.N - n0));
    const __mmask16 mask = rows == TILE ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << rows) - 1);
    for (int i = 0; i < MT; ++i) _mm512_mask_storeu_ps(y + (m0 + i) * w.N + n0, mask, f[t][i]);
  }
}

// Rows [m0, m0 + mt) (mt <= 8) over tiles [t0, t1): few rows take several tiles at once so that the int32
// accumulators form independent chains (one vpdpbusd's latency is several cycles).
// pf: a later task's tiles, fetched during the first call.
template <bool INT4>
void rows_over_tiles(const Packed& w, const Acts& a, int64_t t0, int64_t t1, int64_t m0, int mt, float* y,
                     TilesAhead pf) {
  int64_t t = t0;
#define TANDEM_TILES(NTL, MT)                                                                    \
  for (; t + NTL <= t1; t += NTL, pf = TilesAhead{}) tile_kernel<INT4, NTL, MT>(w, a, t, m0, y, pf); \
  for (; t < t1; ++t, pf = TilesAhead{}) tile_kernel<INT4, 1, MT>(w, a, t, m0, y, pf);               \
  return;
  switch (mt) {
    case 1: TANDEM_TILES(4, 1)
    case 2: TANDEM_TILES(4, 2)
    case 3: TANDEM_TILES(2, 3)
    case 4: TANDEM_TILES(2, 4)
    case 5: TANDEM_TILES(1, 5)
    case 6: TANDEM_TILES(1, 6)
    case 7: TANDEM_TILES(1, 7)
    default: TANDEM_TILES(1, 8)
  }
#undef TANDEM_TILES
}

// ---- Many rows (PANEL_MIN_ROWS to PANEL_MAX_ROWS): register tiles of MR rows x NT weight tiles ----
//
// NT tiles' codes are unpacked once per pair of columns and multiplied with MR rows' broadcast pairs: MR * NT
// independent int32 chains, each broadcast feeding NT vpdpwssd and each unpacked code vector MR (tile_kernel: 8
// chains, one broadcast per vpdpwssd). A task is a group of NT tiles over a block of rows; the group's codes
// (NT * K / 2 bytes for int4) stay in L1 while the rows pass over them. Each output element's arithmetic is
// tile_kernel's, in the same order: the same bits as the tile path for every M (tests/unit/kernels).
template <bool INT4, int NT, int MR>
void panel_kernel(const Packed& w, const Acts& a, int64_t t0, int64_t m0, float* y, TilesAhead pf) {
  constexpr int LOADS = INT4 ? 8 : 16;  // 32-byte loads per block of a tile
  const __m512i nibble = _mm512_set1_epi16(0x0F);
  const int64_t K = a.K, nb = a.nb, tile_bytes = w.nb * LOADS * 32, tile_scales = w.num_groups * TILE;
  const uint8_t* codes = w.codes + t0 * tile_bytes;
  const float* scales = w.scales + t0 * tile_scales;
  const float* zs = w.zs + t0 * tile_scales;
  const int16_t* xr = a.qx + m0 * K;
  const float* dx = a.dx + m0 * nb;
  const float* xsum = a.xsum + m0 * nb;
  __m512 f[NT][MR];
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < MR; ++i) f[t][i] = _mm512_setzero_ps();
  for (int64_t b = 0, g = 0, in_group = 0; b < nb; ++b) {
    pf.step();
    const uint8_t* cb = codes + b * LOADS * 32;
    __m512i acc[NT][MR];
    for (int t = 0; t < NT; ++t)
      for (int i = 0; i < MR; ++i) acc[t][i] = _mm512_setzero_si512();
    const int16_t* xb = xr + b * BLOCK;
#pragma GCC unroll 16
    for (int p = 0; p < LOADS; ++p) {
      __m512i lo[NT], hi[NT];
      for (int t = 0; t < NT; ++t) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + t * tile_bytes + p * 32));
        if constexpr (INT4) {
          const __m512i words = _mm512_cvtepu8_epi16(bytes);
          lo[t] = _mm512_and_si512(words, nibble);
          hi[t] = _mm512_srli_epi16(words, 4);
        } else {
          lo[t] = _mm512_cvtepi8_epi16(bytes);
        }
      }
      for (int i = 0; i < MR; ++i) {
        const __m512i xv = broadcast_pair(xb + i * K + 2 * p);
        for (int t = 0; t < NT; ++t) acc[t][i] = _mm512_dpwssd_epi32(acc[t][i], lo[t], xv);
      }
      if constexpr (INT4) {
        for (int i = 0; i < MR; ++i) {
          const __m512i xv = broadcast_pair(xb + i * K + 2 * (p + 8));
          for (int t = 0; t < NT; ++t) acc[t][i] = _mm512_dpwssd_epi32(acc[t][i], hi[t], xv);
        }
      }
    }
    // the fold: tile_kernel's operations on the same operands
    for (int t = 0; t < NT; ++t) {
      const __m512 s = _mm512_loadu_ps(scales + t * tile_scales + g * TILE);
      const __m512 z = _mm512_loadu_ps(zs + t * tile_scales + g * TILE);
      for (int i = 0; i < MR; ++i) {
        const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(dx[i * nb + b]));
        f[t][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t][i]), sd, f[t][i]);
        if constexpr (INT4) f[t][i] = _mm512_fnmadd_ps(z, _mm512_set1_ps(xsum[i * nb + b]), f[t][i]);
      }
    }
    if (++in_group == w.blocks_per_group) in_group = 0, ++g;
  }
  for (int t = 0; t < NT; ++t) {
    const int64_t n0 = (t0 + t) * TILE;
    const int rows = static_cast<int>(std::min<int64_t>(TILE, w.N - n0));
    const __mmask16 mask = rows == TILE ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << rows) - 1);
    for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(y + (m0 + i) * w.N + n0, mask, f[t][i]);
  }
}

template <bool INT4, int NT, int MR>  // rows <= MR
void panel_rows(const Packed& w, const Acts& a, int64_t t0, int64_t m0, int rows, float* y, const TilesAhead& pf) {
  if (rows == MR) return panel_kernel<INT4, NT, MR>(w, a, t0, m0, y, pf);
  if constexpr (MR > 1) panel_rows<INT4, NT, MR - 1>(w, a, t0, m0, rows, y, pf);
}

template <bool INT4, int NT, int MR>
void gemm_panels(const Packed& w, const Acts& a, int64_t M, float* y) {
  const int64_t tiles = (w.N + TILE - 1) / TILE, groups = (tiles + NT - 1) / NT;
  // rows per task: all of them, unless the groups are fewer than 4 per thread (then blocks of MR-multiples)
  const int64_t want = 4 * tandem_pool::num_threads();
  int64_t row_blocks = groups >= want ? 1 : std::min((want + groups - 1) / groups, (M + MR - 1) / MR);
  const int64_t rows_per_block = ((M + row_blocks - 1) / row_blocks + MR - 1) / MR * MR;
  row_blocks = (M + rows_per_block - 1) / rows_per_block;
  const int64_t tasks = groups * row_blocks;
  tandem_pool::parallel_for(tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t0 = (task / row_blocks) * NT, nt = std::min<int64_t>(NT, tiles - t0);
      const int64_t r0 = (task % row_blocks) * rows_per_block, rows = std::min(rows_per_block, M - r0);
      // row tiles of equal size (+-1): no short last tile, whose few chains would wait on vpdpwssd's latency
      const int64_t num = (rows + MR - 1) / MR, base = rows / num, longer = rows % num;
      // (the first row tile of a group's first row block fetches a later group: PREFETCH_TASKS groups on)
      TilesAhead pf = r0 == 0 ? prefetch_ahead(w, t0, NT, PREFETCH_TASKS, INT4 ? 8 : 16) : TilesAhead{};
      for (int64_t j = 0, m = r0; j < num; ++j, pf = TilesAhead{}) {
        const int r = static_cast<int>(base + (j < longer));
        if (nt == NT) {
          panel_rows<INT4, NT, MR>(w, a, t0, m, r, y, pf);
        } else {
          for (int64_t t = t0; t < t0 + nt; ++t) panel_rows<INT4, 1, MR>(w, a, t, m, r, y, TilesAhead{});
        }
        m += r;
      }
    }
  });
}

template <bool INT4>
torch::Tensor gemm_vnni(const torch::Tensor& x, const Packed& w, bool panels) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / BLOCK;
  auto y = torch::empty({M, w.N}, x.options());
  if (M == 0) return y;
  std::vector<int16_t> qx(M * K);
  std::vector<float> dx(M * nb), xsum(M * nb);
  quantize_rows(x.data_ptr<float>(), M, K, qx.data(), dx.data(), xsum.data());
  const Acts a{qx.data(), dx.data(), xsum.data(), K, nb};
  float* yp = y.data_ptr<float>();
  if (panels) {
    if constexpr (INT4) gemm_panels<true, PANEL_TILES_INT4, PANEL_ROWS_INT4>(w, a, M, yp);
    else gemm_panels<false, PANEL_TILES_INT8, PANEL_ROWS_INT8>(w, a, M, yp);
    return y;
  }
  const int64_t tiles = (w.N + TILE - 1) / TILE;
  constexpr int64_t MT = 8;
  // Small M: chunks of 4 tiles (enough work per claim); large M: one tile each, all rows (the tile's codes stay
  // in L1 while the quantized rows stream from L2).
  const int64_t tiles_per_chunk = M <= 4 ? 4 : 1;
  const int64_t chunks = (tiles + tiles_per_chunk - 1) / tiles_per_chunk;
  tandem_pool::parallel_for(chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t t0 = c * tiles_per_chunk, t1 = std::min(tiles, t0 + tiles_per_chunk);
      // (the first pass of rows fetches a later chunk)
      for (int64_t m0 = 0; m0 < M; m0 += MT)
        rows_over_tiles<INT4>(w, a, t0, t1, m0, static_cast<int>(std::min(MT, M - m0)), yp,
                              m0 == 0 ? prefetch_ahead(w, t0, t1 - t0, PREFETCH_TASKS, INT4 ? 8 : 16) : TilesAhead{});
    }
  });
  return y;
}

#endif  // TANDEM_HAS_VNNI

}  // namespace

bool has_vnni() {
#ifdef TANDEM_HAS_VNNI
  return true;
#else
  return false;
#endif
}

// x fp32 [M, K]; codes uint8 [tiles, K / 32, 8 (int4) or 16 (int8), 32] (pack_vnni); scales and zero_scales fp32
// [tiles, num_groups, 16] -> y fp32 [M, N]. RuntimeError on a CPU build without AVX-512 VNNI.
torch::Tensor gemm_vnni(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor zero_scales,
                      int64_t N, int64_t group_size, bool int4, c10::optional<bool> panels) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  const int64_t K = x.size(1), tiles = (N + TILE - 1) / TILE;
  TORCH_CHECK(K % BLOCK == 0 && group_size > 0 && group_size % BLOCK == 0 && K % group_size == 0,
              "K and group_size must be multiples of 32, and group_size must divide K");
  const int64_t num_groups = K / group_size;
  TORCH_CHECK(codes.scalar_type() == torch::kByte && codes.is_contiguous() && codes.dim() == 4 &&
                  codes.size(0) == tiles && codes.size(1) == K / BLOCK && codes.size(2) == (int4 ? 8 : 16) &&
                  codes.size(3) == 32,
              "codes must be contiguous uint8 [ceil(N / 16), K / 32, ", int4 ? 8 : 16, ", 32]");
  for (const auto* t : {&scales, &zero_scales})
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == tiles &&
                    t->size(1) == num_groups && t->size(2) == TILE,
                "scales and zero_scales must be contiguous float32 [ceil(N / 16), K / group_size, 16]");
#ifdef TANDEM_HAS_VNNI
  const Packed w{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), zero_scales.data_ptr<float>(),
                 K / BLOCK, num_groups, group_size / BLOCK, N};
  const bool use_panels =
      panels.has_value() ? *panels : x.size(0) >= PANEL_MIN_ROWS && x.size(0) < PANEL_MAX_ROWS;
  return int4 ? gemm_vnni<true>(x, w, use_panels) : gemm_vnni<false>(x, w, use_panels);
#else
  TORCH_CHECK(false, "gemm_vnni needs AVX-512 VNNI (this build targets a CPU without it)");
  return x;
#endif
}
