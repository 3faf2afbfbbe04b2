// The elementwise parts of a Llama decoder layer on x86-64 CPUs (fp32; AVX2 + FMA or AVX-512), one call each
// where torch needs 5-15 small ops: RMSNorm, RMSNorm fused with the residual add, rotate-half RoPE on the query
// and key heads fused with the KV-cache write, and SiLU-and-mul.
//
// Why: at decode batch sizes each of these tensors is a few KB, so a decode step is dominated by the per-op cost
// of torch's dispatcher (about 50 ops per layer, 30 layers), not by arithmetic. These are the ops vLLM's CPU
// backend fuses the same way (rms_norm, fused_add_rms_norm, rotary_embedding + reshape_and_cache, silu_and_mul).
//
// Numerics follow the torch references in shared/model.py (HF Llama): RMSNorm in fp32 as x * rsqrt(mean(x^2) +
// eps) then times the weight; RoPE as q * cos + rotate_half(q) * sin with separate products and sum (no FMA, so
// it rounds as torch does); SiLU as x / (1 + e^-x) with simd.h's e^x (clamped: a gate below -87 gives about
// x * e^-88 where torch gives -0, and -inf gives -inf where torch gives NaN). Only the order of the sum of squares differs
// from torch's reduction.
//
// Any width: the SIMD loops end with a scalar tail (H, D / 2 and I need not be multiples of the vector width).
//
// Layouts: x, residual [T, H]; qkv [T, Hq + 2 Hkv, D] (query heads, then key heads, then value heads); cos, sin
// [T, D]; key_cache, value_cache [num_blocks, block_size, Hkv, D] (one layer's pool, viewed as [slots, Hkv, D]);
// slot_mapping int64 [T]; gate_up [T, 2 I] (gate then up). All contiguous fp32.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "simd.h"

namespace {
using namespace tandem_simd;

void check_fp32(const torch::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.dim() == dim, name,
              " must be a contiguous float32 tensor of ", dim, " dims");
}

inline int64_t vector_end(int64_t n) { return n - n % LANES; }  // where the SIMD loop over n floats stops

// out[h] = w[h] * (x[h] * rsqrt(mean(x^2) + eps)) for one row of H floats.
inline void rms_norm_row(const float* x, const float* w, float* out, int64_t H, float eps) {
  const int64_t end = vector_end(H);
  V acc = vzero();
  for (int64_t h = 0; h < end; h += LANES) {
    const V v = vload(x + h);
    acc = vfmadd(v, v, acc);
  }
  float sum = hsum(acc);
  for (int64_t h = end; h < H; ++h) sum += x[h] * x[h];
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(H) + eps);
  const V rv = vbroadcast_value(r);
  for (int64_t h = 0; h < end; h += LANES) store(out + h, vmul(vload(w + h), vmul(vload(x + h), rv)));
  for (int64_t h = end; h < H; ++h) out[h] = w[h] * (x[h] * r);
}

void check_norm(const torch::Tensor& x, const torch::Tensor& weight) {
  check_fp32(x, 2, "x");
  check_fp32(weight, 1, "weight");
  TORCH_CHECK(weight.size(0) == x.size(1), "weight must be [H] with H = x.size(1)");
}

}  // namespace

// RMSNorm (Zhang & Sennrich 2019) as HF Llama: x fp32 [T, H], weight fp32 [H] -> out fp32 [T, H].
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_norm(x, weight);
  auto out = torch::empty_like(x);
  const int64_t T = x.size(0), H = x.size(1);
  for (int64_t t = 0; t < T; ++t)
    rms_norm_row(x.data_ptr<float>() + t * H, weight.data_ptr<float>(), out.data_ptr<float>() + t * H, H,
                 static_cast<float>(eps));
  return out;
}

// In place: residual = x + residual, then x = RMSNorm(residual). x, residual fp32 [T, H]; weight fp32 [H].
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_norm(x, weight);
  check_fp32(residual, 2, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual must have x's shape");
  const float* x0 = x.data_ptr<float>();
  const float* r0 = residual.data_ptr<float>();
  TORCH_CHECK(x0 + x.numel() <= r0 || r0 + residual.numel() <= x0, "x and residual must not overlap");
  const int64_t T = x.size(0), H = x.size(1);
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    float* xr = xp + t * H;
    float* rr = rp + t * H;
    const int64_t end = vector_end(H);
    for (int64_t h = 0; h < end; h += LANES) store(rr + h, vadd(vload(xr + h), vload(rr + h)));
    for (int64_t h = end; h < H; ++h) rr[h] = xr[h] + rr[h];
    rms_norm_row(rr, weight.data_ptr<float>(), xr, H, static_cast<float>(eps));
  }
}

// Rotate-half RoPE (Su et al. 2021, HF Llama's layout) on the query and key heads of qkv fp32 [T, Hq + 2 Hkv, D]
// with cos, sin fp32 [T, D]; the rotated keys and the values are written into key_cache / value_cache fp32
// [num_blocks, block_size, Hkv, D] at slot_mapping int64 [T]. Returns the rotated queries fp32 [T, Hq, D].
torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor slot_mapping, int64_t num_heads) {
  check_fp32(qkv, 3, "qkv");
  check_fp32(cos, 2, "cos");
  check_fp32(sin, 2, "sin");
  check_fp32(key_cache, 4, "key_cache");
  check_fp32(value_cache, 4, "value_cache");
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
  const float* src = qkv.data_ptr<float>();
  float* kc = key_cache.data_ptr<float>();
  float* vc = value_cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos.data_ptr<float>() + t * D;
    const float* s = sin.data_ptr<float>() + t * D;
    const float* row = src + t * qkv.size(1) * D;
    for (int64_t h = 0; h < num_heads + Hkv; ++h) {
      const float* x = row + h * D;
      float* out = h < num_heads ? q.data_ptr<float>() + (t * num_heads + h) * D
                                 : kc + (slots[t] * Hkv + (h - num_heads)) * D;
      // x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
      const int64_t end = vector_end(half);
      for (int64_t d = 0; d < end; d += LANES) {
        const V x1 = vload(x + d), x2 = vload(x + half + d);
        store(out + d, vsub(vmul(x1, vload(c + d)), vmul(x2, vload(s + d))));
        store(out + half + d, vadd(vmul(x2, vload(c + half + d)), vmul(x1, vload(s + half + d))));
      }
      for (int64_t d = end; d < half; ++d) {
        const float x1 = x[d], x2 = x[half + d];
        out[d] = x1 * c[d] - x2 * s[d];
        out[half + d] = x2 * c[half + d] + x1 * s[half + d];
      }
    }
    std::memcpy(vc + slots[t] * Hkv * D, row + (num_heads + Hkv) * D, sizeof(float) * Hkv * D);
  }
  return q;
}

// SiLU-and-mul (the SwiGLU MLP of Shazeer 2020): gate_up fp32 [T, 2 I] -> silu(gate) * up fp32 [T, I].
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_fp32(gate_up, 2, "gate_up");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up's last dim must be 2 I");
  auto out = torch::empty({T, I}, gate_up.options());
  const V one = vbroadcast_value(1.0f), zero = vzero();
  for (int64_t t = 0; t < T; ++t) {
    const float* g = gate_up.data_ptr<float>() + t * 2 * I;
    float* o = out.data_ptr<float>() + t * I;
    const int64_t end = vector_end(I);
    for (int64_t i = 0; i < end; i += LANES) {
      const V x = vload(g + i);
      const V silu = vdiv(x, vadd(one, vexp(vsub(zero, x))));
      store(o + i, vmul(silu, vload(g + I + i)));
    }
    for (int64_t i = end; i < I; ++i)  // (e^x clamped as simd.h's vexp does, so every column rounds alike)
      o[i] = g[i] / (1.0f + std::exp(std::min(std::max(-g[i], -87.0f), 88.0f))) * g[I + i];
  }
  return out;
}
