// The CPU kernels' entry points (each defined in its .cpp file beside its layout notes), for the Python module
// (module.cpp) and for the kernels that call others (decoder_stack.cpp).
#pragma once
#include <torch/extension.h>

torch::Tensor int8_gemm(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, int64_t group_size);
torch::Tensor int4_gemm(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor zero_scales,
                        int64_t group_size);
torch::Tensor gemm_vnni(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor zero_scales,
                      int64_t N, int64_t group_size, bool int4, c10::optional<bool> panels);
bool has_vnni();
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t window, double softcap, int64_t kv_format);
torch::Tensor paged_prefill_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                      torch::Tensor block_tables, torch::Tensor query_start_loc,
                                      torch::Tensor context_lens, double scale, int64_t window, double softcap);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor slot_mapping, int64_t num_heads);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor argmax_rows(torch::Tensor logits);
torch::Tensor dense_gemm(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias,
                         c10::optional<bool> packed);
bool dense_gemm_packed_available(bool bf16);
void add_lora(torch::Tensor y, torch::Tensor x, torch::Tensor lora_a, torch::Tensor lora_b, torch::Tensor seg_starts,
              torch::Tensor seg_lens, torch::Tensor seg_slots);
// Registers decoder_stack.cpp's classes (DecoderStack, StackLinear) in the module.
void bind_decoder_stack(pybind11::module_& m);
