"""Triton kernels, each beside its pure-torch reference (*_ref) and a wrapper that validates its arguments.

Import the modules directly (kernels.paged_attention, kernels.prefill_attention, kernels.kv_cache_write,
kernels.quant_gemm, kernels.rmsnorm); this package imports nothing so that CPU-only code never loads triton.
Tools: `python -m kernels.bench` (CUDA timings), `python -m kernels.compile_check` (compile for sm_90, no GPU).
"""
