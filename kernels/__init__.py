"""Triton kernels, each beside its pure-torch reference (*_ref) and a wrapper that validates its arguments.

Import the modules directly (tandem.kernels.paged_attention, tandem.kernels.prefill_attention, tandem.kernels.kv_cache_write,
tandem.kernels.quant_gemm, tandem.kernels.rmsnorm); this package imports nothing so that CPU-only code never loads triton.
kernels.int4_format is the INT4 packing the quantized layers and the W4A16 kernel share (torch only, no triton).
Kernels know tensors, not the engine: nothing here imports shared/.
NOTE: tandem.kernels.rmsnorm is not used by the engine yet (shared/model.py normalizes with torch ops on every device);
its fused residual form is meant for a later fused decoder layer.
Tools: `python -m tandem.kernels.bench` (CUDA timings), `python -m tandem.kernels.compile_check` (compile for sm_90, no GPU).
"""
