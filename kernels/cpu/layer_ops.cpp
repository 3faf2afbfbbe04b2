// The elementwise parts of a Llama decoder layer on x86-64 CPUs (fp32 or bf16 activations; AVX2 + FMA or
// AVX-512), one call each where torch needs 5-15 small ops: RMSNorm, RMSNorm fused with the residual add,
// rotate-half RoPE on the query and key heads fused with the KV-cache write, and SiLU-and-mul; and the greedy
// sampler's argmax over the vocabulary (argmax_rows, at the end).
//
// Why: at decode batch sizes each of these tensors is a few KB, so a decode step is dominated by the per-op cost
// of torch's dispatcher (about 50 ops per layer, 30 layers), not by arithmetic. These are the ops vLLM's CPU
// backend fuses the same way (rms_norm, fused_add_rms_norm, rotary_embedding + reshape_and_cache, silu_and_mul).
//
// Numerics follow the torch references in kernels/cpu_layer_ops.py (HF Llama), in fp32 inside, with the
// roundings to the element type T where torch rounds in T (bf16; in fp32 those are no-ops):
// - RMSNorm: T(w * T(x * rsqrt(mean(x^2) + eps))) (HF LlamaRMSNorm: normalized in fp32, cast, times the weight in
//   T); with the residual, residual = T(x + residual) first;
// - RoPE: T(q * cos + rotate_half(q) * sin) with fp32 cos, sin, separate products and sum (no FMA, so it rounds as
//   torch does), rounded once;
// - SiLU: T(T(x / (1 + e^-x)) * up) with simd.h's e^x (clamped: a gate below -87 gives about x * e^-88 where torch
//   gives -0, and -inf gives -inf where torch gives NaN; in bf16 torch's e^x may round the SiLU 1 ulp apart).
// Only the order of the sum of squares differs from torch's reduction.
//
// Any width: the SIMD loops end with a scalar tail (H, D / 2 and I need not be multiples of the vector width).
// Rows are independent: a prefill chunk's are split over the kernels' threads (for_rows), a decode step's few run
// on the caller.
//
// Layouts: x, residual [T, H]; qkv [T, Hq + 2 Hkv, D] (query heads, then key heads, then value heads); cos, sin
// [T, D] fp32; key_cache, value_cache [num_blocks, block_size, Hkv, D] (one layer's pool, viewed as
// [slots, Hkv, D]); slot_mapping int64 [T]; gate_up [T, 2 I] (gate then up). All contiguous; activations, weight
// and caches all fp32 or all bf16.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "simd.h"
#include "thread_pool.h"

namespace {
using namespace tandem_simd;

// fn(begin, end) over rows [0, T) of elems_per_row elements each: on the kernels' threads (tandem_pool) in chunks of
// at least ROW_CHUNK_ELEMS elements, so a prefill chunk's rows are split and a decode step's few rows stay on the
// caller (waking a helper costs more than they do).
constexpr int64_t ROW_CHUNK_ELEMS = 1 << 16;
template <typename Fn>
void for_rows(int64_t T, int64_t elems_per_row, const Fn& fn) {
  const int64_t grain = std::max<int64_t>(1, ROW_CHUNK_ELEMS / std::max<int64_t>(1, elems_per_row));
  tandem_pool::parallel_for(T, grain, [&](int64_t begin, int64_t end) { fn(begin, end); });
}

void check_float(const torch::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK((t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16) && t.is_contiguous() &&
                  t.dim() == dim, name, " must be a contiguous float32 or bfloat16 tensor of ", dim, " dims");
}

void check_dtype(const torch::Tensor& t, const torch::Tensor& like, const char* name) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have the activations' dtype (", like.scalar_type(),
              "), not ", t.scalar_type());
}

// fn.template operator()<T>() with T the C++ element type of t's dtype (float or at::BFloat16).
template <typename Fn>
auto dispatch(const torch::Tensor& t, Fn&& fn) {
  if (t.scalar_type() == torch::kFloat) return fn(float{});
  return fn(at::BFloat16{});
}

inline int64_t vector_end(int64_t n) { return n - n % LANES; }  // where the SIMD loop over n elements stops

// out[h] = T(w[h] * T(x[h] * rsqrt(mean(x^2) + eps))) for one row of H elements.
template <typename T>
inline void rms_norm_row(const T* x, const T* w, T* out, int64_t H, float eps) {
  const int64_t end = vector_end(H);
  V acc = vzero();
  for (int64_t h = 0; h < end; h += LANES) {
    const V v = load_f32(x + h);
    acc = vfmadd(v, v, acc);
  }
  float sum = hsum(acc);
  for (int64_t h = end; h < H; ++h) sum += to_f32(x[h]) * to_f32(x[h]);
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(H) + eps);
  const V rv = vbroadcast_value(r);
  for (int64_t h = 0; h < end; h += LANES)
    store_f32(out + h, vmul(load_f32(w + h), round_to<T>(vmul(load_f32(x + h), rv))));
  for (int64_t h = end; h < H; ++h) out[h] = from_f32<T>(to_f32(w[h]) * round_to<T>(to_f32(x[h]) * r));
}

void check_norm(const torch::Tensor& x, const torch::Tensor& weight) {
  check_float(x, 2, "x");
  check_float(weight, 1, "weight");
  check_dtype(weight, x, "weight");
  TORCH_CHECK(weight.size(0) == x.size(1), "weight must be [H] with H = x.size(1)");
}

// x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], for one head of D = 2 half elements.
template <typename T>
inline void rope_head(const T* x, const float* c, const float* s, T* out, int64_t half) {
  const int64_t end = vector_end(half);
  for (int64_t d = 0; d < end; d += LANES) {
    const V x1 = load_f32(x + d), x2 = load_f32(x + half + d);
    store_f32(out + d, vsub(vmul(x1, vload(c + d)), vmul(x2, vload(s + d))));
    store_f32(out + half + d, vadd(vmul(x2, vload(c + half + d)), vmul(x1, vload(s + half + d))));
  }
  for (int64_t d = end; d < half; ++d) {
    const float x1 = to_f32(x[d]), x2 = to_f32(x[half + d]);
    out[d] = from_f32<T>(x1 * c[d] - x2 * s[d]);
    out[half + d] = from_f32<T>(x2 * c[half + d] + x1 * s[half + d]);
  }
}

// silu(gate) * up for one row of I gates and I ups: T(T(x / (1 + e^-x)) * up).
template <typename T>
inline void silu_and_mul_row(const T* g, const T* u, T* o, int64_t I) {
  const V one = vbroadcast_value(1.0f), zero = vzero();
  const int64_t end = vector_end(I);
  for (int64_t i = 0; i < end; i += LANES) {
    const V x = load_f32(g + i);
    const V silu = vdiv(x, vadd(one, vexp(vsub(zero, x))));
    store_f32(o + i, vmul(round_to<T>(silu), load_f32(u + i)));
  }
  for (int64_t i = end; i < I; ++i) {  // (e^x clamped as simd.h's vexp does, so every column rounds alike)
    const float x = to_f32(g[i]);
    const float silu = x / (1.0f + std::exp(std::min(std::max(-x, -87.0f), 88.0f)));
    o[i] = from_f32<T>(round_to<T>(silu) * to_f32(u[i]));
  }
}

}  // namespace

// RMSNorm (Zhang & Sennrich 2019) as HF Llama: x [T, H], weight [H] -> out [T, H], fp32 or bf16 (all alike).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_norm(x, weight);
  auto out = torch::empty_like(x);
  const int64_t T = x.size(0), H = x.size(1);
  dispatch(x, [&](auto zero) {
    using E = decltype(zero);
    const E* xp = x.data_ptr<E>();
    const E* w = weight.data_ptr<E>();
    E* op = out.data_ptr<E>();
    for_rows(T, H, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) rms_norm_row(xp + t * H, w, op + t * H, H, static_cast<float>(eps));
    });
  });
  return out;
}

// In place: residual = x + residual, then x = RMSNorm(residual). x, residual [T, H]; weight [H]; fp32 or bf16.
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_norm(x, weight);
  check_float(residual, 2, "residual");
  check_dtype(residual, x, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual must have x's shape");
  const char* x0 = static_cast<const char*>(x.data_ptr());
  const char* r0 = static_cast<const char*>(residual.data_ptr());
  TORCH_CHECK(x0 + x.nbytes() <= r0 || r0 + residual.nbytes() <= x0, "x and residual must not overlap");
  const int64_t T = x.size(0), H = x.size(1);
  dispatch(x, [&](auto zero) {
    using E = decltype(zero);
    E* xp = x.data_ptr<E>();
    E* rp = residual.data_ptr<E>();
    const E* w = weight.data_ptr<E>();
    for_rows(T, H, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        E* xr = xp + t * H;
        E* rr = rp + t * H;
        const int64_t stop = vector_end(H);
        for (int64_t h = 0; h < stop; h += LANES) store_f32(rr + h, vadd(load_f32(xr + h), load_f32(rr + h)));
        for (int64_t h = stop; h < H; ++h) rr[h] = from_f32<E>(to_f32(xr[h]) + to_f32(rr[h]));
        rms_norm_row(rr, w, xr, H, static_cast<float>(eps));
      }
    });
  });
}

// Rotate-half RoPE (Su et al. 2021, HF Llama's layout) on the query and key heads of qkv [T, Hq + 2 Hkv, D] with
// cos, sin fp32 [T, D]; the rotated keys and the values are written into key_cache / value_cache [num_blocks,
// block_size, Hkv, D] at slot_mapping int64 [T]. Returns the rotated queries [T, Hq, D]. qkv and the caches fp32
// or bf16 (all alike); the rotation is in fp32, rounded once.
torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor slot_mapping, int64_t num_heads) {
  check_float(qkv, 3, "qkv");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat, "cos and sin must be fp32");
  check_float(cos, 2, "cos");
  check_float(sin, 2, "sin");
  check_float(key_cache, 4, "key_cache");
  check_float(value_cache, 4, "value_cache");
  check_dtype(key_cache, qkv, "key_cache");
  check_dtype(value_cache, qkv, "value_cache");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.is_contiguous() && slot_mapping.dim() == 1,
              "slot_mapping must be contiguous int64 [T]");
  const int64_t T = qkv.size(0), D = qkv.size(2), Hkv = key_cache.size(2), half = D / 2;
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.size(3) == D, "the caches must be [num_blocks, "
              "block_size, Hkv, D] with qkv's D");
  TORCH_CHECK(qkv.size(1) == num_heads + 2 * Hkv && D % 2 == 0, "qkv must be [T, Hq + 2 Hkv, D] with D even");
  TORCH_CHECK(cos.size(0) == T && cos.size(1) == D && sin.sizes() == cos.sizes() && slot_mapping.size(0) == T,
              "cos, sin [T, D] and slot_mapping [T] must match qkv");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot_mapping holds a slot outside the cache");
  auto q = torch::empty({T, num_heads, D}, qkv.options());
  dispatch(qkv, [&](auto zero) {
    using E = decltype(zero);
    const E* src = qkv.data_ptr<E>();
    E* kc = key_cache.data_ptr<E>();
    E* vc = value_cache.data_ptr<E>();
    E* qp = q.data_ptr<E>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    const int64_t width = qkv.size(1) * D;
    // (rows write distinct query rows and, through distinct slots, distinct cache rows)
    for_rows(T, width, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cp + t * D;
        const float* s = sp + t * D;
        const E* row = src + t * width;
        for (int64_t h = 0; h < num_heads + Hkv; ++h) {
          E* out = h < num_heads ? qp + (t * num_heads + h) * D : kc + (slots[t] * Hkv + (h - num_heads)) * D;
          rope_head(row + h * D, c, s, out, half);
        }
        std::memcpy(vc + slots[t] * Hkv * D, row + (num_heads + Hkv) * D, sizeof(E) * Hkv * D);
      }
    });
  });
  return q;
}

// SiLU-and-mul (the SwiGLU MLP of Shazeer 2020): gate_up [T, 2 I] -> silu(gate) * up [T, I], fp32 or bf16.
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_float(gate_up, 2, "gate_up");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up's last dim must be 2 I");
  auto out = torch::empty({T, I}, gate_up.options());
  dispatch(gate_up, [&](auto zero) {
    using E = decltype(zero);
    const E* gp = gate_up.data_ptr<E>();
    E* op = out.data_ptr<E>();
    for_rows(T, 2 * I, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) silu_and_mul_row(gp + t * 2 * I, gp + t * 2 * I + I, op + t * I, I);
    });
  });
  return out;
}

// Greedy sampling's argmax: logits [M, V] fp32 -> int64 [M], each row's index of its largest value, the first where
// several are equal; a row holding a NaN gives its first NaN's index (torch.argmax's rule). Two passes over a row:
// the maximum (and whether a NaN is there), then the first lane equal to it. Rows are split over the kernels'
// threads. Why: torch's argmax takes 1.3 ms for 32 rows of a 49,152-token vocabulary on one thread, scalar.
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.scalar_type() == torch::kFloat && logits.is_contiguous() && logits.dim() == 2 &&
                  logits.size(1) > 0, "logits must be a contiguous float32 tensor [rows, vocab] with vocab > 0");
  const int64_t M = logits.size(0), Vn = logits.size(1), vend = vector_end(Vn);
  auto out = torch::empty({M}, logits.options().dtype(torch::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for_rows(M, Vn, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* x = lp + m * Vn;
      float best = -std::numeric_limits<float>::infinity();
      bool nan = false;
      if (vend > 0) {
        V mv = vload(x), nan_v = vzero();
        for (int64_t i = 0; i < vend; i += LANES) {
          const V v = vload(x + i);
          mv = vmax(mv, v);
          nan_v = vadd(nan_v, vsub(v, v));  // 0, or NaN where v is NaN or infinite
        }
        float lanes[LANES];
        store(lanes, mv);
        best = *std::max_element(lanes, lanes + LANES);
        store(lanes, nan_v);
        for (float f : lanes) nan = nan || std::isnan(f);
      }
      for (int64_t i = vend; i < Vn; ++i) {
        nan = nan || std::isnan(x[i]);
        best = std::max(best, x[i]);
      }
      int64_t found = -1;
      if (nan) {  // (inf - inf is NaN too: look for a real NaN, else go on with the max)
        for (int64_t i = 0; i < Vn && found < 0; ++i)
          if (std::isnan(x[i])) found = i;
      }
      if (found < 0) {
        const V b = vbroadcast_value(best);
        int64_t i = 0;
        for (; i < vend && found < 0; i += LANES) {
#ifdef __AVX512F__
          const uint32_t eq = _mm512_cmp_ps_mask(vload(x + i), b, _CMP_EQ_OQ);
#else
          const uint32_t eq = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(vload(x + i), b, _CMP_EQ_OQ)));
#endif
          if (eq) found = i + __builtin_ctz(eq);
        }
        for (i = vend; i < Vn && found < 0; ++i)
          if (x[i] == best) found = i;
      }
      op[m] = found;
    }
  });
  return out;
}
