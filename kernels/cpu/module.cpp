// The Python module of the CPU kernels (kernels/cpu_ext.py builds qgemm.cpp, attention.cpp and this file).
#include <torch/extension.h>

torch::Tensor int8_gemm(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, int64_t group_size);
torch::Tensor int4_gemm(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor zero_scales,
                        int64_t group_size);
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_gemm", &int8_gemm, "y = x @ dequant(int8 W).T");
  m.def("int4_gemm", &int4_gemm, "y = x @ ((int4 codes - zeros) * scales).T");
  m.def("paged_decode_attention", &paged_decode_attention, "one query token per sequence over the paged KV cache");
}
