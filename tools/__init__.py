"""Command-line tools around the engine: model preparation, quantization and its evaluation (not served code)."""
