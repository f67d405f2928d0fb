"""The DFlash drafter: the block-diffusion model (`model`), its loader and packaged checkpoints (`loader`),
its quantized forms (`quantize` for GGUF targets on a CPU, `int8` on a GPU) and the token shortlist (`vocab`)."""
