"""The native decoder layers (`cpu_decoder.cpp`), bound to the functions of the other CPU extensions.

The extension calls the products and fused operations through the function capsules those extensions export, so
it runs the very code the Python layers run. `native_decoder(products)` returns it bound to the fused layer
operations and to the products extensions of the kinds asked for (float32, amx, int8), or None where one of them,
the layer operations or the decoder itself does not build here (logged once, never retried): the layers then run from Python.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from dflash.kernels.build import (
    AmxKernel,
    DecoderKernel,
    Int8Kernel,
    KernelUnavailable,
    QuantKernel,
    load_amx_kernel,
    load_decoder_kernel,
    load_int8_kernel,
    load_layer_ops,
    load_quant_kernel,
)

__all__ = ["PRODUCT_KERNELS", "native_decoder"]

log = logging.getLogger(__name__)

# product kind -> the loader of the extension that computes it
PRODUCT_KERNELS: dict[str, Callable[[], QuantKernel | AmxKernel | Int8Kernel]] = {
    "float32": load_quant_kernel, "amx": load_amx_kernel, "int8": load_int8_kernel,
}

_kernel: DecoderKernel | None = None
_unavailable = False
_bound: set[str] = set()
_unbindable: set[str] = set()


def native_decoder(products: Iterable[str]) -> DecoderKernel | None:
    """The native decoder bound to the layer operations and the `products` kernels, or None (see the module)."""
    global _kernel, _unavailable
    if _kernel is None:
        if _unavailable:
            return None
        try:
            kernel, ops = load_decoder_kernel(), load_layer_ops()
        except KernelUnavailable as exc:
            _unavailable = True
            log.warning("native CPU decoder layers unavailable, the layers run from Python: %s", exc)
            return None
        kernel.bind(None, None, None, ops.rms_norm_capsule, ops.rotary_capsule, ops.attention_capsule,
                    ops.attention_segments_capsule, ops.silu_mul_capsule)
        _kernel = kernel
    for kind in set(products) - _bound:
        if kind in _unbindable or not _bind_products(_kernel, kind):
            _unbindable.add(kind)
            return None
    return _kernel


def _bind_products(kernel: DecoderKernel, kind: str) -> bool:
    """Binds the `kind` products extension's matmul; False where it does not build or cannot run here."""
    try:
        products = PRODUCT_KERNELS[kind]()
    except (KernelUnavailable, KeyError):
        return False
    available = getattr(products, "available", None)
    if available is not None and not available():
        return False
    capsule = products.matmul_capsule
    int8, float32, amx = (capsule if kind == name else None for name in ("int8", "float32", "amx"))
    panels = products.panel_matmul_capsule if kind == "int8" else None
    kernel.bind(int8, float32, amx, None, None, None, None, None, panels)
    _bound.add(kind)
    return True
