"""Kernels: C++ CPU kernels compiled on first use (products with GGUF-quantized weights in float32 or on AMX tiles,
fused layer operations) and Triton GPU programs (fused layer steps, skinny products, split-key attention, DDTree)."""
