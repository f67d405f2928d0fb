"""CPU kernels compiled on first use: matrix products with GGUF-quantized weights."""
