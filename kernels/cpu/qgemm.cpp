// Weight-only quantized GEMM for x86-64 CPUs with AVX2 + FMA or AVX-512 (fp32 activations and accumulators).
//
// Computes, for every activation row m and output row n,
//     y[m, n] = sum_g scales[n, g] * sum_{k in group g} q[n, k] * x[m, k]  -  sum_g zs[n, g] * X[m, g]
// where q are the integer codes (int8, or int4 in [0, 15]), and for int4 zs = zeros * scales and X = x summed
// per group: (q - z) * s = q * s - z * s, so the zero point costs one FMA per group instead of one per weight.
//
// Why: on CPU a decode step is bound by the weight bytes it reads. Dequantizing a whole weight to fp32 before a
// float matmul reads the codes, writes 4x as many fp32 bytes and reads them back, so it loses to fp32. Here the
// codes are widened to fp32 in registers next to the FMA (the method of llama.cpp's ggml and gpt-fast) and each
// code byte is read once per block of MR activation rows. Per-group partial sums take the scale out of the
// inner loop: one FMA per group instead of one multiply per weight.
//
// Layouts: int8 qweight [N, K] (shared/quant/layers.py); int4 codes uint8 [N, K / 2] in this kernel's own
// order, made once per layer by kernels/cpu_qgemm.py repack_int4: in each 32-column chunk, byte j holds k = j
// (low nibble) and k = j + 16 (high nibble), so both nibble halves meet contiguous x; scales fp32 [N, K / G].
// K % 32 == 0 and G % 32 == 0 (checked in Python and here).
#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

namespace {

// One SIMD vector of floats: 16 lanes with AVX-512 (when the compiler targets it: -march=native), else 8 (AVX2).
#ifdef __AVX512F__
using V = __m512;
constexpr int LANES = 16;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline V vfmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline float hsum(V v) { return _mm512_reduce_add_ps(v); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline void store(float* p, V v) { _mm512_storeu_ps(p, v); }
#else
using V = __m256;
constexpr int LANES = 8;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline V vfmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
inline float hsum(V v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif
constexpr int VPC = 32 / LANES;  // vectors per 32-column chunk

// 32 codes of row n starting at column 32 * c, widened to VPC vectors of floats in x's order.
struct Int8Codes {
  const int8_t* q;
  int64_t K;
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

// y[m0 + i, n0 + j] for i < MR, j < NR. NR * MR * 2 accumulators + the codes + 1 scale fit the registers.
template <int NR, int MR, typename Codes>
inline void block(const Codes& codes, const float* scales, int64_t num_groups, int64_t chunks_per_group,
                  const float* x, int64_t K, float* y, int64_t N, int64_t n0) {
  V acc[NR][MR];
  for (int j = 0; j < NR; ++j)
    for (int i = 0; i < MR; ++i) acc[j][i] = vzero();
  for (int64_t g = 0; g < num_groups; ++g) {
    V part[NR][MR];
    for (int j = 0; j < NR; ++j)
      for (int i = 0; i < MR; ++i) part[j][i] = vzero();
    for (int64_t c = g * chunks_per_group; c < (g + 1) * chunks_per_group; ++c) {
      for (int j = 0; j < NR; ++j) {
        V w[VPC];
        codes.load(n0 + j, c, w);
        for (int v = 0; v < VPC; ++v)
          for (int i = 0; i < MR; ++i) part[j][i] = vfmadd(w[v], vload(x + i * K + 32 * c + LANES * v), part[j][i]);
      }
    }
    for (int j = 0; j < NR; ++j) {
      const V s = vbroadcast(scales + (n0 + j) * num_groups + g);
      for (int i = 0; i < MR; ++i) acc[j][i] = vfmadd(part[j][i], s, acc[j][i]);
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int i = 0; i < MR; ++i) y[i * N + n0 + j] = hsum(acc[j][i]);
}

// Larger M: dequantize NT output rows once into an L1-resident buffer (codes * scale), then multiply it with MT
// activation rows at a time held in accumulators: each weight is widened once per call instead of once per block.
constexpr int NT = 4;
constexpr int MT = LANES == 16 ? 6 : 3;  // NT * MT accumulators + 1 input vector fit the 32 (16) registers

template <typename Codes>
inline void dequant_rows(const Codes& codes, const float* scales, int64_t num_groups, int64_t chunks_per_group,
                         int64_t K, int64_t n0, float* buf) {
  for (int j = 0; j < NT; ++j) {
    for (int64_t c = 0; c < K / 32; ++c) {
      V w[VPC];
      codes.load(n0 + j, c, w);
      const V s = vbroadcast(scales + (n0 + j) * num_groups + c / chunks_per_group);
      for (int v = 0; v < VPC; ++v) {
        V d = vmul(w[v], s);
        store(buf + j * K + 32 * c + LANES * v, d);
      }
    }
  }
}

template <int ROWS>
inline void micro_kernel(const float* buf, const float* x, int64_t K, float* y, int64_t N, int64_t n0) {
  V acc[NT][ROWS];
  for (int j = 0; j < NT; ++j)
    for (int i = 0; i < ROWS; ++i) acc[j][i] = vzero();
  for (int64_t k = 0; k < K; k += LANES) {
    for (int i = 0; i < ROWS; ++i) {
      const V xv = vload(x + i * K + k);
      for (int j = 0; j < NT; ++j) acc[j][i] = vfmadd(vload(buf + j * K + k), xv, acc[j][i]);
    }
  }
  for (int j = 0; j < NT; ++j)
    for (int i = 0; i < ROWS; ++i) y[i * N + n0 + j] = hsum(acc[j][i]);
}

template <int ROWS>
inline void tail_rows(const float* buf, const float* x, int64_t rows, int64_t K, float* y, int64_t N, int64_t n0) {
  if constexpr (ROWS > 0) {
    if (rows == ROWS) return micro_kernel<ROWS>(buf, x, K, y, N, n0);
    tail_rows<ROWS - 1>(buf, x, rows, K, y, N, n0);
  }
}

template <typename Codes>
torch::Tensor grouped_gemm(const torch::Tensor& x, const Codes& codes, const torch::Tensor& scales, int64_t N,
                           int64_t group_size, const float* zs = nullptr) {
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ng = K / group_size, cpg = group_size / 32;
  const int64_t num_tiles = N / NT;
  at::parallel_for(0, num_tiles, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(M >= 2 ? NT * K : 0);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = NT * t;
      if (M == 1) {
        block<4, 1>(codes, sp, ng, cpg, xp, K, yp, N, n0);
      } else {
        dequant_rows(codes, sp, ng, cpg, K, n0, buf.data());
        int64_t m = 0;
        for (; m + MT <= M; m += MT) micro_kernel<MT>(buf.data(), xp + m * K, K, yp + m * N, N, n0);
        tail_rows<MT - 1>(buf.data(), xp + m * K, M - m, K, yp + m * N, N, n0);
      }
    }
  });
  for (int64_t n = NT * num_tiles; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) block<1, 1>(codes, sp, ng, cpg, xp + m * K, K, yp + m * N, N, n);
  if (zs != nullptr) {  // y -= X @ zs.T, X [M, ng] the per-group sums of x
    auto group_sums = x.view({M, ng, group_size}).sum(-1);
    y.sub_(torch::mm(group_sums, torch::from_blob(const_cast<float*>(zs), {N, ng}, x.options()).t()));
  }
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
  return grouped_gemm(x, Int8Codes{qweight.data_ptr<int8_t>(), K}, scales, N, group_size);
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
  return grouped_gemm(x, Int4Codes{qweight.data_ptr<uint8_t>(), K}, scales, N, group_size,
                      zero_scales.data_ptr<float>());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_gemm", &int8_gemm, "y = x @ dequant(int8 W).T");
  m.def("int4_gemm", &int4_gemm, "y = x @ ((int4 codes - zeros) * scales).T");
}
