"""The GPU fast path: decode-time forwards with fixed shapes and addresses, captured once as CUDA graphs."""
