// Weight-only quantized GEMM for x86-64 CPUs with AVX2 + FMA or AVX-512 (fp32 activations and accumulators).
//
// y[m, n] = sum_k x[m, k] * w[n, k] with w = q * s (int8, symmetric) or (q - z) * s (int4, asymmetric), one scale
// s (and zero z) per row and group of G columns.
//
// Why: on CPU a decode step is bound by the weight bytes it reads. Dequantizing a whole weight to fp32 before a
// float matmul reads the codes, writes 4x as many fp32 bytes and reads them back, so it loses to fp32. Here the
// codes are widened to fp32 in registers next to the FMA (the method of llama.cpp's ggml and gpt-fast), so each
// code byte is read once per call:
// - M == 1: per-group partial sums of q * x take the scale out of the inner loop (one FMA per group), and the
//   zero point is sum_g z s X_g with X_g the group's sum of x, since (q - z) * s = q * s - z * s.
// - M > 1: a tile of 4 rows is dequantized once into an L1-resident buffer and multiplied with up to 6 (AVX2: 3)
//   rows of x at a time held in registers.
//
// Layouts: int8 qweight [N, K] (shared/quant/layers.py); int4 codes uint8 [N, K / 2] in this kernel's own
// order, made once per layer by kernels/cpu_qgemm.py repack_int4: in each 32-column chunk, byte j holds k = j
// (low nibble) and k = j + 16 (high nibble), so both nibble halves meet contiguous x; scales fp32 [N, K / G].
// K % 32 == 0 and G % 32 == 0 (checked in Python and here).
#include <torch/extension.h>

#include "simd.h"
#include "thread_pool.h"

#include <algorithm>
#include <vector>

namespace {
using namespace tandem_simd;

constexpr int VPC = 32 / LANES;  // vectors per 32-column chunk
constexpr int64_t PREFETCH_ROWS = 2 * 4;  // two tiles ahead: at M = 1 the LM head read 1.5x faster

// 32 codes of row n starting at column 32 * c, widened to VPC vectors of floats in x's order.
struct Int8Codes {
  const int8_t* q;
  int64_t K;
  inline const int8_t* row(int64_t n) const { return q + n * K; }
  inline void load(int64_t n, int64_t c, V w[VPC]) const {
    const int8_t* p = q + n * K + 32 * c;
#ifdef __AVX512F__
    for (int v = 0; v < 2; ++v)
      w[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * v))));
#else
    for (int v = 0; v < 4; ++v)
      w[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * v))));
#endif
  }
};

struct Int4Codes {
  const uint8_t* q;
  int64_t K;  // unpacked K
  inline const uint8_t* row(int64_t n) const { return q + n * (K / 2); }
  inline void load(int64_t n, int64_t c, V w[VPC]) const {
    __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * (K / 2) + 16 * c));
#ifdef __AVX512F__
    __m512i a = _mm512_cvtepu8_epi32(bytes);
    w[0] = _mm512_cvtepi32_ps(_mm512_and_si512(a, _mm512_set1_epi32(0xF)));  // k 0..15
    w[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(a, 4));                     // k 16..31
#else
    const __m256i low = _mm256_set1_epi32(0xF);
    __m256i a = _mm256_cvtepu8_epi32(bytes);                     // bytes 0..7
    __m256i b = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));  // bytes 8..15
    w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, low));         // k 0..7
    w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, low));         // k 8..15
    w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));          // k 16..23
    w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));          // k 24..31
#endif
  }
};

// A quantized weight as the loops see it: codes, one scale per (row, group), and for int4 zs = zeros * scales.
template <typename Codes>
struct Weight {
  Codes codes;
  const float* scales;  // [N, num_groups]
  const float* zs;      // [N, num_groups] or nullptr (int8: no zero point)
  int64_t num_groups, chunks_per_group;
  inline int64_t group_of_chunk(int64_t c) const { return c / chunks_per_group; }
  int64_t N;
  // Ask for rows [n, n + rows) (codes and scales) ahead of use: each tile's rows are short streams.
  inline void prefetch_rows(int64_t n, int rows) const {
    if (n + rows > N) return;
    const char* c0 = reinterpret_cast<const char*>(codes.row(n));
    const char* c1 = reinterpret_cast<const char*>(codes.row(n + rows));
    for (const char* p = c0; p < c1; p += 64) _mm_prefetch(p, _MM_HINT_T0);
    const char* s0 = reinterpret_cast<const char*>(scales + n * num_groups);
    const char* s1 = reinterpret_cast<const char*>(scales + (n + rows) * num_groups);
    for (const char* p = s0; p < s1; p += 64) _mm_prefetch(p, _MM_HINT_T0);
    if (zs != nullptr) {
      const char* z0 = reinterpret_cast<const char*>(zs + n * num_groups);
      const char* z1 = reinterpret_cast<const char*>(zs + (n + rows) * num_groups);
      for (const char* p = z0; p < z1; p += 64) _mm_prefetch(p, _MM_HINT_T0);
    }
  }
};

// M == 1 (and the N % 4 tail): y[n0 + j] for j < NR, reading each code once. Per-group partial sums take the scale
// out of the inner loop; the zero point is one scalar FMA per group with X[g] = sum of x over the group.
template <int NR, typename Codes>
inline void gemv_block(const Weight<Codes>& w, const float* x, const float* x_group_sums, float* y, int64_t n0) {
  V acc[NR];
  float zero_terms[NR] = {};
  w.prefetch_rows(n0 + PREFETCH_ROWS, NR);
  for (int j = 0; j < NR; ++j) acc[j] = vzero();
  for (int64_t g = 0; g < w.num_groups; ++g) {
    V part[NR];
    for (int j = 0; j < NR; ++j) part[j] = vzero();
    for (int64_t c = g * w.chunks_per_group; c < (g + 1) * w.chunks_per_group; ++c) {
      for (int j = 0; j < NR; ++j) {
        V codes[VPC];
        w.codes.load(n0 + j, c, codes);
        for (int v = 0; v < VPC; ++v) part[j] = vfmadd(codes[v], vload(x + 32 * c + LANES * v), part[j]);
      }
    }
    for (int j = 0; j < NR; ++j) {
      const int64_t sg = (n0 + j) * w.num_groups + g;
      acc[j] = vfmadd(part[j], vbroadcast(w.scales + sg), acc[j]);
      if (w.zs != nullptr) zero_terms[j] += w.zs[sg] * x_group_sums[g];
    }
  }
  for (int j = 0; j < NR; ++j) y[n0 + j] = hsum(acc[j]) - zero_terms[j];
}

// M > 1: dequantize NT output rows once into an L1-resident buffer ((q - z) * s), then multiply it with MT
// activation rows at a time held in accumulators: each weight is widened once per call, not once per row.
constexpr int NT = 4;
constexpr int MT = LANES == 16 ? 6 : 3;  // NT * MT accumulators + 1 input vector fit the 32 (16) registers

template <typename Codes>
inline void dequant_rows(const Weight<Codes>& w, int rows, int64_t K, int64_t n0, float* buf) {
  for (int j = 0; j < rows; ++j) {
    for (int64_t c = 0; c < K / 32; ++c) {
      V codes[VPC];
      w.codes.load(n0 + j, c, codes);
      const int64_t sg = (n0 + j) * w.num_groups + w.group_of_chunk(c);
      const V s = vbroadcast(w.scales + sg);
      const V minus_zs = vbroadcast_value(w.zs != nullptr ? -w.zs[sg] : 0.0f);
      for (int v = 0; v < VPC; ++v) store(buf + j * K + 32 * c + LANES * v, vfmadd(codes[v], s, minus_zs));
    }
  }
  for (int j = rows; j < NT; ++j) std::fill(buf + j * K, buf + (j + 1) * K, 0.0f);  // the N % NT tail
}

template <int ROWS>
inline void micro_kernel(const float* buf, int rows, const float* x, int64_t K, float* y, int64_t N, int64_t n0) {
  V acc[NT][ROWS];
  for (int j = 0; j < NT; ++j)
    for (int i = 0; i < ROWS; ++i) acc[j][i] = vzero();
  for (int64_t k = 0; k < K; k += LANES) {
    for (int i = 0; i < ROWS; ++i) {
      const V xv = vload(x + i * K + k);
      for (int j = 0; j < NT; ++j) acc[j][i] = vfmadd(vload(buf + j * K + k), xv, acc[j][i]);
    }
  }
  for (int j = 0; j < rows; ++j)
    for (int i = 0; i < ROWS; ++i) y[i * N + n0 + j] = hsum(acc[j][i]);
}

template <int ROWS>
inline void tail_rows(const float* buf, int rows, const float* x, int64_t m_left, int64_t K, float* y, int64_t N,
                      int64_t n0) {
  if constexpr (ROWS > 0) {
    if (m_left == ROWS) return micro_kernel<ROWS>(buf, rows, x, K, y, N, n0);
    tail_rows<ROWS - 1>(buf, rows, x, m_left, K, y, N, n0);
  }
}

template <typename Codes>
torch::Tensor grouped_gemm(const torch::Tensor& x, const Weight<Codes>& w, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;  // (a prefill step that samples nothing)
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<float> x_group_sums;  // [num_groups] of the one row, for the M == 1 zero-point term
  if (M == 1 && w.zs != nullptr) {
    const int64_t group_size = K / w.num_groups;
    x_group_sums.assign(w.num_groups, 0.0f);
    for (int64_t k = 0; k < K; ++k) x_group_sums[k / group_size] += xp[k];
  }
  const int64_t num_tiles = (N + NT - 1) / NT;
  tandem_pool::parallel_for(num_tiles, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(M > 1 ? NT * K : 0);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = NT * t;
      const int rows = static_cast<int>(std::min<int64_t>(NT, N - n0));
      if (M == 1) {
        if (rows == NT) {
          gemv_block<NT>(w, xp, x_group_sums.data(), yp, n0);
        } else {
          for (int j = 0; j < rows; ++j) gemv_block<1>(w, xp, x_group_sums.data(), yp, n0 + j);
        }
        continue;
      }
      w.prefetch_rows(n0 + PREFETCH_ROWS, NT);
      dequant_rows(w, rows, K, n0, buf.data());
      int64_t m = 0;
      for (; m + MT <= M; m += MT) micro_kernel<MT>(buf.data(), rows, xp + m * K, K, yp + m * N, N, n0);
      tail_rows<MT - 1>(buf.data(), rows, xp + m * K, M - m, K, yp + m * N, N, n0);
    }
  });
  return y;
}

void check_common(const torch::Tensor& x, const torch::Tensor& scales, int64_t N, int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(1) % 32 == 0 && group_size % 32 == 0 && x.size(1) % group_size == 0,
              "K and group_size must be multiples of 32, and group_size must divide K");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == x.size(1) / group_size,
              "scales must be contiguous float32 [N, K / group_size]");
}

}  // namespace

// x fp32 [M, K]; qweight int8 [N, K]; scales fp32 [N, K / group_size] -> y fp32 [M, N].
torch::Tensor int8_gemm(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, int64_t group_size) {
  const int64_t N = qweight.size(0), K = x.size(1);
  check_common(x, scales, N, group_size);
  TORCH_CHECK(qweight.scalar_type() == torch::kChar && qweight.is_contiguous() && qweight.size(1) == K,
              "qweight must be contiguous int8 [N, K]");
  Weight<Int8Codes> w{{qweight.data_ptr<int8_t>(), K}, scales.data_ptr<float>(), nullptr, K / group_size,
                      group_size / 32, N};
  return grouped_gemm(x, w, N);
}

// x fp32 [M, K]; codes uint8 [N, K / 2] (repack_int4 order); scales, zero_scales (zeros * scales) fp32
// [N, K / group_size] -> y fp32 [M, N].
torch::Tensor int4_gemm(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor zero_scales,
                        int64_t group_size) {
  const int64_t N = qweight.size(0), K = x.size(1);
  check_common(x, scales, N, group_size);
  TORCH_CHECK(qweight.scalar_type() == torch::kByte && qweight.is_contiguous() && qweight.size(1) == K / 2,
              "qweight must be contiguous uint8 [N, K / 2]");
  TORCH_CHECK(zero_scales.sizes() == scales.sizes() && zero_scales.scalar_type() == torch::kFloat &&
                  zero_scales.is_contiguous(), "zero_scales must be contiguous float32, shaped like scales");
  Weight<Int4Codes> w{{qweight.data_ptr<uint8_t>(), K}, scales.data_ptr<float>(), zero_scales.data_ptr<float>(),
                      K / group_size, group_size / 32, N};
  return grouped_gemm(x, w, N);
}
