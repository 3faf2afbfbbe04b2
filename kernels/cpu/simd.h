// The SIMD vector of floats the CPU kernels are written in: 16 lanes with AVX-512 (when the compiler targets it,
// e.g. -march=native on an AVX-512 CPU), else 8 lanes of AVX2 + FMA.
#pragma once
#include <immintrin.h>

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

}  // namespace tandem_simd
