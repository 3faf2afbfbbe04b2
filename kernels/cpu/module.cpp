// The Python module of the CPU kernels (kernels/cpu_ext.py builds qgemm.cpp, qgemm_vnni.cpp, dense_gemm.cpp,
// dense_gemm_packed.cpp, attention.cpp, prefill_attention.cpp, layer_ops.cpp, lora.cpp, decoder_stack.cpp,
// thread_pool.cpp and this file; ops.h declares what each defines).
#include <torch/extension.h>

#include "ops.h"
#include "thread_pool.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_gemm", &int8_gemm, "y = x @ dequant(int8 W).T");
  m.def("int4_gemm", &int4_gemm, "y = x @ ((int4 codes - zeros) * scales).T");
  m.def("gemm_vnni", &gemm_vnni,
        "y = x~ @ dequant(int4 or int8 W).T, x~ = x quantized to int16 per 32 columns; panels: the many-row path "
        "(None: by M)",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("zero_scales"), py::arg("N"), py::arg("group_size"),
        py::arg("int4"), py::arg("panels") = py::none());
  m.def("has_vnni", &has_vnni, "whether gemm_vnni runs here (built for a CPU with AVX-512 VNNI)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "one query token per sequence over the paged KV cache (float or quantized)");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of query chunks over the paged KV cache (fp32 or bf16)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "in place: residual += x; x = RMSNorm(residual)");
  m.def("rope_write_kv", &rope_write_kv, "RoPE on query and key heads; keys and values into the KV cache");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("argmax_rows", &argmax_rows, "each row's first index of its largest value (torch.argmax(-1)'s rule)");
  m.def("dense_gemm", &dense_gemm, "y = x @ W.T (+ bias), fp32 or bf16; packed: the packed path (None: by M)",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("packed") = py::none());
  m.def("dense_gemm_packed_available", &dense_gemm_packed_available,
        "whether dense_gemm's packed path runs here for bf16 (built with AVX512-BF16) or fp32 (with AVX-512)",
        py::arg("bf16"));
  m.def("add_lora", &add_lora, "in place: y[rows of s] += (x[rows of s] @ lora_a[slot s].T) @ lora_b[slot s].T",
        py::arg("y"), py::arg("x"), py::arg("lora_a"), py::arg("lora_b"), py::arg("seg_starts"), py::arg("seg_lens"),
        py::arg("seg_slots"));
  bind_decoder_stack(m);
  m.def("set_num_threads", &tandem_pool::set_num_threads, "threads of the GEMM and attention kernels, the caller's included");
  m.def("get_num_threads", &tandem_pool::num_threads, "threads of the GEMM and attention kernels");
}
