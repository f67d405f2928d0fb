"""The GPU fast path: decode-time forwards with fixed shapes and addresses, captured once as CUDA graphs; fused layer
programs, DDTree's rounds kept on the device (`resident`, `device_tree`), and batched steps for offline work."""
