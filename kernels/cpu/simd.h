// The SIMD vector of floats the CPU kernels are written in: 16 lanes with AVX-512 (when the compiler targets it,
// e.g. -march=native on an AVX-512 CPU), else 8 lanes of AVX2 + FMA; and the element types they read and write:
// fp32, or bf16 widened to fp32 in registers and rounded back to nearest even (as c10::BFloat16(float) and torch's
// vectorized casts round).
#pragma once
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <type_traits>

namespace tandem_simd {

// One SIMD vector of floats: 16 lanes with AVX-512 (when the compiler targets it: -march=native), else 8 (AVX2).
#ifdef __AVX512F__
using V = __m512;
constexpr int LANES = 16;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline V vfmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline V vbroadcast_value(float v) { return _mm512_set1_ps(v); }
inline float hsum(V v) { return _mm512_reduce_add_ps(v); }
inline void store(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline V vmin(V a, V b) { return _mm512_min_ps(a, b); }
inline V vfnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline V vround(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V vexp2i(V n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#else
using V = __m256;
constexpr int LANES = 8;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline V vfmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline V vbroadcast_value(float v) { return _mm256_set1_ps(v); }
inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vdiv(V a, V b) { return _mm256_div_ps(a, b); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
inline V vmin(V a, V b) { return _mm256_min_ps(a, b); }
inline V vfnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b
inline V vround(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V vexp2i(V n) {  // 2^n for integral n in [-126, 127]
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline float hsum(V v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// e^x, relative error about 2e-7 (float rounding) for x in [-87, 88]; inputs outside are clamped (e^-87 ~ 1.6e-38).
// Method: Cephes expf: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for e^r, times 2^n.
inline V vexp(V x) {
  x = vmax(vmin(x, vbroadcast_value(88.0f)), vbroadcast_value(-87.0f));
  const V n = vround(vmul(x, vbroadcast_value(1.44269504088896341f)));
  V r = vfnmadd(n, vbroadcast_value(0.693359375f), x);
  r = vfnmadd(n, vbroadcast_value(-2.12194440e-4f), r);
  V p = vbroadcast_value(1.9875691500e-4f);
  p = vfmadd(p, r, vbroadcast_value(1.3981999507e-3f));
  p = vfmadd(p, r, vbroadcast_value(8.3334519073e-3f));
  p = vfmadd(p, r, vbroadcast_value(4.1665795894e-2f));
  p = vfmadd(p, r, vbroadcast_value(1.6666665459e-1f));
  p = vfmadd(p, r, vbroadcast_value(5.0000001201e-1f));
  const V y = vadd(vfmadd(vmul(p, r), r, r), vbroadcast_value(1.0f));
  return vmul(y, vexp2i(n));
}

// bf16 <-> fp32. A bf16 is the upper 16 bits of a float: widening is a shift (exact); narrowing rounds to nearest
// even with the bias trick of c10's round_to_nearest_even (u + 0x7fff + the kept part's lowest bit), NaN -> 0x7fc0.
// (Not vcvtneps2bf16, which flushes subnormal inputs to zero where torch keeps them.)
#ifdef __AVX512F__
inline __m512i round_bits(V v) {  // v rounded to bf16, as the upper 16 bits of each lane (lower 16: zero)
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                                     _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc00000));
}
inline V load_f32(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store_f32(at::BFloat16* p, V v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bits(v), 16)));
}
inline V vround_bf16(V v) { return _mm512_castsi512_ps(round_bits(v)); }
#else
inline V load_f32(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256i round_bits(V v) {  // v rounded to bf16, as the upper 16 bits of each lane (lower 16: zero)
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
                                     _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan);
}
inline void store_f32(at::BFloat16* p, V v) {
  const __m256i h = _mm256_srli_epi32(round_bits(v), 16);  // 8 values < 2^16 in 32-bit lanes
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline V vround_bf16(V v) { return _mm256_castsi256_ps(round_bits(v)); }
#endif

// LANES elements of T at p as fp32, and back (rounded to T); round_to<T>(v): v rounded to T, kept in fp32 (a
// rounding torch does between two ops in bf16, e.g. silu(gate) before * up).
inline V load_f32(const float* p) { return vload(p); }
inline void store_f32(float* p, V v) { store(p, v); }
template <typename T>
inline V round_to(V v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return vround_bf16(v);
}

// Bytes a kernel reads next (`rows` rows of row_bytes each, stride bytes apart; one row: a contiguous range),
// fetched into L2 a share at a time while it computes the current ones, so that a weight streaming from memory
// arrives while the multiply pipes are busy. (A burst of the whole next tile into L1 let the loads wait: at 8 rows
// the dense fp32 linears took the sum of their arithmetic's and their reads' times, docs/performance.md.) The
// kernels step it at the rate they read the current tile, so it runs out as they reach the next. Default: nothing.
struct Prefetch {
  const char* row = nullptr;
  int64_t row_bytes = 0, rows = 0, stride = 0, at = 0;
  Prefetch() = default;
  Prefetch(const void* begin, int64_t row_bytes_, int64_t rows_ = 1, int64_t stride_ = 0)
      : row(static_cast<const char*>(begin)), row_bytes(row_bytes_), rows(rows_), stride(stride_) {}
  // the next `bytes` of the range (whole 64-byte lines), or what is left of it. (Inlined: a call inside a kernel's
  // loop would spill its accumulators around it.)
  __attribute__((always_inline)) inline void step(int64_t bytes) {
    for (; bytes > 0 && rows > 0; bytes -= 64) {
      _mm_prefetch(row + at, _MM_HINT_T1);
      if ((at += 64) >= row_bytes) at = 0, row += stride, --rows;
    }
  }
};

// The scalar forms (the loops' tails): c10's conversions, the same roundings.
inline float to_f32(float v) { return v; }
inline float to_f32(at::BFloat16 v) { return static_cast<float>(v); }
template <typename T>
inline T from_f32(float v) { return static_cast<T>(v); }
template <typename T>
inline float round_to(float v) { return to_f32(from_f32<T>(v)); }

}  // namespace tandem_simd
