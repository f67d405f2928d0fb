"""Model runtime: configuration-driven decoder-only transformers with hidden-state capture, loaded from HF folders or
GGUF files with dense or quantized weights."""
