// A Llama-family model's decoder layers as one call from Python: the loop of LlamaForCausalLM.forward over
// DecoderLayer.forward (shared/model.py), calling the same kernels in the same order with the same arguments, so
// its results are those of the Python loop bit for bit (tests/unit/test_decoder_stack.py).
//
// Why: a decode step of a small model is about 270 kernel calls of 5-500 us each, and each call from Python costs
// 5-15 us around the kernel (the module's forward, the wrapper's checks, the weight's layout lookup, pybind): 4 ms
// of a 10-16 ms step of the packaged GGUF at 1-8 sequences, 1.4-3 ms in fp32 and bf16 (docs/performance.md).
// Here a step's layers cost one call, made without the GIL, so the server's event loop runs meanwhile. The same
// idea as CUDA graphs for a GPU's launch cost, and as llama.cpp's graph of the whole model.
//
// Per layer (x the previous layer's output, residual the stream before it; the first layer starts from the
// embeddings with no residual):
//   x, residual = RMSNorm(x + residual), x + residual       (fused_add_rms_norm; the first layer: rms_norm)
//   qkv = x @ Wqkv.T;  q = RoPE(q), K/V written at slot_mapping   (rope_write_kv)
//   o = attention(q, the layer's cache)                      (paged_decode_attention or paged_prefill_attention)
//   x = o @ Wo.T;  x, residual = RMSNorm(x + residual), x + residual
//   x = (silu(g) * u) @ Wdown.T with [g, u] = x @ Wgate_up.T
// Each linear is dense (dense_gemm, or torch's linear past max_rows rows, as CpuDenseLinear) or integer (gemm_vnni
// on the packed codes, as WeightOnlyInt4Linear / WeightOnlyInt8Linear, x zero-padded to padded_k).
//
// Staleness: the stack holds the model's own float tensors (the same TensorImpls, so a change of their data is
// seen); watch() records the (data_ptr, version) of the tensors its integer layouts were derived from, and stale()
// says whether any has changed since (the caller rebuilds), the key shared/quant/layers.py's _derived uses.
#include <torch/extension.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "ops.h"

namespace {

struct StackLinear {
  bool integer = false;
  torch::Tensor weight;                     // dense: [N, K] fp32 or bf16
  int64_t max_rows = -1;                    // dense: past this many rows of x, torch's linear (-1: never)
  torch::Tensor codes, scales, zero_scales;  // integer: gemm_vnni's packed weight (kernels/cpu_qgemm.py pack_vnni)
  int64_t out_features = 0, group_size = 0, padded_k = 0;
  bool int4 = false;
  c10::optional<torch::Tensor> bias;        // [N] of the activations' dtype

  static StackLinear dense(torch::Tensor weight, c10::optional<torch::Tensor> bias, int64_t max_rows) {
    StackLinear l;
    l.weight = weight;
    l.bias = bias;
    l.max_rows = max_rows;
    return l;
  }

  static StackLinear vnni(torch::Tensor codes, torch::Tensor scales, torch::Tensor zero_scales, int64_t out_features,
                          int64_t group_size, bool int4, int64_t padded_k, c10::optional<torch::Tensor> bias) {
    StackLinear l;
    l.integer = true;
    l.codes = codes;
    l.scales = scales;
    l.zero_scales = zero_scales;
    l.out_features = out_features;
    l.group_size = group_size;
    l.int4 = int4;
    l.padded_k = padded_k;
    l.bias = bias;
    return l;
  }

  torch::Tensor operator()(const torch::Tensor& x) const {  // x [T, K] contiguous -> [T, N]
    if (!integer) {
      // (the model's own tensors, held as they are: .contiguous() is free unless one was made strided since)
      if (max_rows >= 0 && x.size(0) > max_rows) return at::linear(x, weight, bias);
      c10::optional<torch::Tensor> b;
      if (bias.has_value() && bias->defined()) b = bias->contiguous();
      return dense_gemm(x, weight.contiguous(), b, c10::nullopt);
    }
    torch::Tensor x2 = x.size(1) == padded_k ? x : at::constant_pad_nd(x, {0, padded_k - x.size(1)});
    torch::Tensor y = gemm_vnni(x2, codes, scales, zero_scales, out_features, group_size, int4, c10::nullopt);
    if (bias.has_value() && bias->defined()) y.add_(*bias);
    return y;
  }
};

struct Layer {
  torch::Tensor input_norm, post_norm;  // [H]
  StackLinear qkv, o, gate_up, down;
  int64_t window;  // sliding window in tokens (0: the whole context)
};

class DecoderStack {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, double eps, double scale, double softcap)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), eps_(eps), scale_(scale), softcap_(softcap) {}

  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, StackLinear qkv, StackLinear o,
                 StackLinear gate_up, StackLinear down, int64_t window) {
    layers_.push_back(Layer{input_norm, post_norm, std::move(qkv), std::move(o),
                            std::move(gate_up), std::move(down), window});
  }

  void watch(const std::vector<torch::Tensor>& sources) {
    for (const auto& t : sources) watched_.push_back({t, {t.data_ptr(), t._version()}});
  }

  bool stale() const {
    for (const auto& [t, key] : watched_)
      if (t.data_ptr() != key.first || t._version() != key.second) return true;
    return false;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [T, H] (the embeddings; overwritten); cos, sin fp32 [T, D]; kv_caches [L', 2, num_blocks, block_size, Hkv,
  // D] (at most the first L' layers run); slot_mapping int64 [T]. decode_kernel: attention through
  // paged_decode_attention with block_tables [rows, max_blocks] int32 and context_lens [rows] int32, one query row
  // each (a decode batch, or every query row of short queries with its own causal length); otherwise
  // paged_prefill_attention with block_tables [S, max_blocks], context_lens [S] and query_start_loc [S + 1].
  // num_layers: the first that many layers. Returns (the last layer's MLP output, the residual stream
  // before it), both [T, H].
  std::vector<torch::Tensor> forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor kv_caches,
                                     torch::Tensor slot_mapping, bool decode_kernel, torch::Tensor block_tables,
                                     torch::Tensor context_lens, torch::Tensor query_start_loc, int64_t num_layers) {
    TORCH_CHECK(kv_caches.dim() == 6 && kv_caches.size(1) == 2,
                "kv_caches must be [layers, 2, num_blocks, block_size, num_kv_heads, head_dim]");
    TORCH_CHECK(num_layers >= 0, "num_layers must be >= 0, got ", num_layers);
    // (as the Python loop's zip: the layers that have a cache)
    const int64_t n = std::min({num_layers, this->num_layers(), kv_caches.size(0)});
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, H] tensor");
    const int64_t T = x.size(0), D = kv_caches.size(5);
    cos = cos.contiguous();
    sin = sin.contiguous();
    slot_mapping = slot_mapping.contiguous();
    torch::Tensor residual;
    for (int64_t l = 0; l < n; ++l) {
      const Layer& layer = layers_[l];
      const torch::Tensor key_cache = kv_caches.select(0, l).select(0, 0);
      const torch::Tensor value_cache = kv_caches.select(0, l).select(0, 1);
      if (l == 0) {
        residual = x;
        x = rms_norm(x, layer.input_norm.contiguous(), eps_);
      } else {
        fused_add_rms_norm(x, residual, layer.input_norm.contiguous(), eps_);
      }
      torch::Tensor qkv = layer.qkv(x).view({T, num_heads_ + 2 * num_kv_heads_, D});
      torch::Tensor q = rope_write_kv(qkv, cos, sin, key_cache, value_cache, slot_mapping, num_heads_);
      torch::Tensor attn =
          decode_kernel ? paged_decode_attention(q, key_cache, value_cache, block_tables, context_lens, scale_,
                                                 layer.window, softcap_, 0)
                        : paged_prefill_attention(q, key_cache, value_cache, block_tables, query_start_loc,
                                                  context_lens, scale_, layer.window, softcap_);
      x = layer.o(attn.view({T, num_heads_ * D}));
      fused_add_rms_norm(x, residual, layer.post_norm.contiguous(), eps_);
      x = layer.down(silu_and_mul(layer.gate_up(x)));
    }
    return {x, residual};
  }

 private:
  int64_t num_heads_, num_kv_heads_;
  double eps_, scale_, softcap_;
  std::vector<Layer> layers_;
  std::vector<std::pair<torch::Tensor, std::pair<void*, int64_t>>> watched_;
};

}  // namespace

void bind_decoder_stack(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<StackLinear>(m, "StackLinear", "one linear of a DecoderStack (dense or gemm_vnni's packed weight)")
      .def_static("dense", &StackLinear::dense, py::arg("weight"), py::arg("bias"), py::arg("max_rows"))
      .def_static("vnni", &StackLinear::vnni, py::arg("codes"), py::arg("scales"), py::arg("zero_scales"),
                  py::arg("out_features"), py::arg("group_size"), py::arg("int4"), py::arg("padded_k"),
                  py::arg("bias"));
  py::class_<DecoderStack>(m, "DecoderStack", "a Llama-family model's decoder layers as one call")
      .def(py::init<int64_t, int64_t, double, double, double>(), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("eps"), py::arg("scale"), py::arg("softcap"))
      .def("add_layer", &DecoderStack::add_layer, py::arg("input_norm"), py::arg("post_norm"), py::arg("qkv"),
           py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("window"))
      .def("watch", &DecoderStack::watch, "record the sources' (data_ptr, version) for stale()")
      .def("stale", &DecoderStack::stale, "whether a watched tensor has changed since watch()")
      .def_property_readonly("num_layers", &DecoderStack::num_layers)
      .def("forward", &DecoderStack::forward, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("cos"),
           py::arg("sin"), py::arg("kv_caches"), py::arg("slot_mapping"), py::arg("decode_kernel"),
           py::arg("block_tables"), py::arg("context_lens"), py::arg("query_start_loc"), py::arg("num_layers"));
}
