"""Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling"): proposers and the
acceptance rule. The engine verifies proposals as more tokens of the same step (shared/scheduler.py)."""
