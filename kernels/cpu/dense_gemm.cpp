// Dense (float) GEMM for few activation rows on x86-64 CPUs with AVX2 + FMA or AVX-512: the linears of a decode
// step, whose cost is reading the weight.
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), w fp32 or bf16, x fp32 or bf16 (the same type as w), products
// and sums in fp32, y in x's type (bf16 rounded to nearest even, once, as torch's bf16 matmul rounds).
//
// Why: at M <= 16 a decode step is bound by the weight bytes it reads, and torch's matmul on one thread reads a
// bf16 or fp32 weight at 15-18 GB/s here (about a third of a STREAM copy, docs/performance.md). Here each tile of
// NT weight rows is streamed once per call and multiplied with MT rows of x held in registers; bf16 weights are
// widened to fp32 in registers (a 16-bit shift: exact), so the bytes read are the checkpoint's. The outer loop
// runs on the kernels' own thread pool (thread_pool.h), so a decode engine with one torch thread still reads with
// every kernel thread.
//
// From PACKED_MIN_ROWS rows (fp32 where the CPU has AVX-512, bf16 where it has AVX512-BF16) dense_gemm_packed.cpp
// runs instead: bound by arithmetic there, its register tiles over a repacked weight panel do more per instruction
// than these dot products.
//
// Layouts: x [M, K] and w [N, K] contiguous (nn.Linear's), K % 32 == 0 (checked in Python and here).
#include <torch/extension.h>

#include "simd.h"
#include "thread_pool.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace {
using namespace tandem_simd;

constexpr int NT = 4;                   // weight rows per tile
constexpr int MT = LANES == 16 ? 6 : 2; // x rows per register block: NT * MT accumulators + NT + 1 vectors
// tiles ahead of use (a decode step's fp32 linears at 8 rows: 23.5 ms a pass 1 ahead, 25.8 at 2, 27.2 at 4)
constexpr int64_t PREFETCH_TILES = 1;

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

inline void store_out(float* y, float v) { *y = v; }
inline void store_out(at::BFloat16* y, float v) { *y = at::BFloat16(v); }  // (c10: round to nearest even)

// acc[j][i] += the products of x row i and weight row wr[j] over K, per lane (fp32).
template <int ROWS, typename T>
inline void accumulate(const T* x, const T* const wr[NT], int64_t K, V acc[NT][ROWS], Prefetch pf) {
  for (int64_t k = 0; k < K; k += LANES) {
    pf.step(NT * LANES * sizeof(T));  // (the tile ahead: NT rows, at the rate this one is read)
    V wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = load_f32(wr[j] + k);
    for (int i = 0; i < ROWS; ++i) {
      const V xv = load_f32(x + i * K + k);
      for (int j = 0; j < NT; ++j) acc[j][i] = vfmadd(wv[j], xv, acc[j][i]);
    }
  }
}

#ifdef __AVX512BF16__
// bf16 with AVX512-BF16: vdpbf16ps multiplies 32 bf16 pairs into 16 fp32 lanes (exact products, fp32 sums, inputs'
// and outputs' subnormals flushed), twice the arithmetic of widening + FMA, so a prefill chunk runs here too.
template <int ROWS>
inline void accumulate(const at::BFloat16* x, const at::BFloat16* const wr[NT], int64_t K, V acc[NT][ROWS],
                       Prefetch pf) {
  for (int64_t k = 0; k < K; k += 32) {
    pf.step(NT * 32 * sizeof(at::BFloat16));
    __m512bh wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wr[j] + k);
    for (int i = 0; i < ROWS; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * K + k);
      for (int j = 0; j < NT; ++j) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], wv[j], xv);
    }
  }
}
#endif

// y[m0 + i, n0 + j] for i < ROWS, j < rows (rows <= NT; absent rows read row n0 again and are not stored).
template <int ROWS, typename T>
inline void micro_kernel(const T* x, const T* w, const T* bias, T* y, int64_t K, int64_t N, int64_t n0, int rows,
                         Prefetch pf) {
  V acc[NT][ROWS];
  const T* wr[NT];
  for (int j = 0; j < NT; ++j) {
    wr[j] = w + (n0 + (j < rows ? j : 0)) * K;
    for (int i = 0; i < ROWS; ++i) acc[j][i] = vzero();
  }
  accumulate<ROWS>(x, wr, K, acc, pf);
  for (int j = 0; j < rows; ++j) {
    const float b = bias != nullptr ? to_float(bias[n0 + j]) : 0.0f;
    for (int i = 0; i < ROWS; ++i) store_out(y + i * N + n0 + j, hsum(acc[j][i]) + b);
  }
}

template <int ROWS, typename T>
inline void rows_left(const T* x, const T* w, const T* bias, T* y, int64_t m_left, int64_t K, int64_t N, int64_t n0,
                      int rows, Prefetch pf) {
  if constexpr (ROWS > 0) {
    if (m_left == ROWS) return micro_kernel<ROWS>(x, w, bias, y, K, N, n0, rows, pf);
    rows_left<ROWS - 1>(x, w, bias, y, m_left, K, N, n0, rows, pf);
  }
}

template <typename T>
void dense_gemm_block(const T* x, const T* w, const T* bias, T* y, int64_t M, int64_t K, int64_t N) {
  const int64_t num_tiles = (N + NT - 1) / NT;
  // NOTE: tiles are claimed 8 at a time: fine enough to balance 2-8 threads over N >= 576, coarse enough that the
  // shared counter is not contended.
  tandem_pool::parallel_for(num_tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = NT * t;
      const int rows = static_cast<int>(std::min<int64_t>(NT, N - n0));
      // (the first pass over the tile fetches the one ahead, NT rows of w: contiguous; the others find this one
      // in L1)
      const int64_t ahead = n0 + PREFETCH_TILES * NT;
      Prefetch pf = ahead + NT <= N ? Prefetch(w + ahead * K, NT * K * static_cast<int64_t>(sizeof(T))) : Prefetch();
      int64_t m = 0;
      for (; m + MT <= M; m += MT, pf = Prefetch())
        micro_kernel<MT>(x + m * K, w, bias, y + m * N, K, N, n0, rows, pf);
      rows_left<MT - 1>(x + m * K, w, bias, y + m * N, M - m, K, N, n0, rows, pf);
    }
  });
}

// rows of x from which dense_gemm_packed.cpp runs instead, where it is built: fewer rows stream the weight from
// memory faster here, more are bound by arithmetic, which its register tiles do with fewer instructions. Measured on
// the Zen 4 host of 2026-12-06, a decode step's linears of the default model streaming from memory (the per-row path
// with its spread prefetch): bf16 per-row 11.8 / 12.7 / 16.0 / 20.9 / 22.9 ms at 6 / 8 / 12 / 16 / 20 rows against
// packed 16.7 / 18.0 / 19.3 / 26.7 / 24.5, at 22 level, at 24 and 32 packed 1.09-1.11x faster; fp32 per-row ahead up
// to 16 rows (23.3 ms at 8 against 31.6), level at 20, packed 1.08-1.10x faster at 24 and 32.
constexpr int64_t PACKED_MIN_ROWS = 22;

constexpr int64_t MC = 16 * MT;  // x rows per pass over the weight: an L2-resident block of x (96 x K fp32)

template <typename T>
void dense_gemm_impl(const T* x, const T* w, const T* bias, T* y, int64_t M, int64_t K, int64_t N) {
  // (a prefill chunk: the weight streams once per MC rows of x, so x's block stays in L2 while it does)
  for (int64_t m0 = 0; m0 < M; m0 += MC) dense_gemm_block(x + m0 * K, w, bias, y + m0 * N, std::min(MC, M - m0), K, N);
}

}  // namespace

// dense_gemm_packed.cpp: a repacked weight panel, for many rows: bf16 where built with AVX512-BF16, fp32 with
// AVX-512 (elsewhere they raise)
bool dense_gemm_packed_available(bool bf16);
void dense_gemm_packed(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* y,
                       int64_t M, int64_t K, int64_t N);
void dense_gemm_packed(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N);

namespace {
template <typename T>
void dense_gemm_typed(const T* x, const T* w, const T* bias, T* y, int64_t M, int64_t K, int64_t N,
                      c10::optional<bool> packed) {
  const bool built = dense_gemm_packed_available(std::is_same_v<T, at::BFloat16>);
  if (packed.has_value() ? *packed : built && M >= PACKED_MIN_ROWS) {
    TORCH_CHECK(built, "the packed GEMM needs AVX-512 (fp32) or AVX512-BF16 (bf16): not in this build");
    dense_gemm_packed(x, w, bias, y, M, K, N);
  } else {
    dense_gemm_impl<T>(x, w, bias, y, M, K, N);
  }
}
}  // namespace

// x [M, K] and weight [N, K] both fp32 or both bf16, contiguous, K % 32 == 0; bias [N] of that type or empty ->
// y [M, N] of that type. packed: through dense_gemm_packed.cpp (true), through the per-row tiles here (false), or
// (none) the packed path from PACKED_MIN_ROWS rows where it is built.
torch::Tensor dense_gemm(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias,
                         c10::optional<bool> packed) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.is_contiguous() && weight.is_contiguous(),
              "x [M, K] and weight [N, K] must be contiguous 2-D tensors");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() &&
                  (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "x and weight must be both float32 or both bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K && K % 32 == 0, "weight must be [N, K] with x's K, a multiple of 32");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(), "bias must be contiguous [N] of x's dtype");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  if (x.scalar_type() == torch::kFloat) {
    dense_gemm_typed(x.data_ptr<float>(), weight.data_ptr<float>(), has_bias ? bias->data_ptr<float>() : nullptr,
                     y.data_ptr<float>(), M, K, N, packed);
  } else {
    dense_gemm_typed(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(),
                     has_bias ? bias->data_ptr<at::BFloat16>() : nullptr, y.data_ptr<at::BFloat16>(), M, K, N, packed);
  }
  return y;
}
