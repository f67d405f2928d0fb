"""When the eager layers use the fused CPU operations (`cpu_layer_ops.cpp`).

A one-token step of a small model on a CPU spends much of its time in the fixed cost of torch operations on
tiny tensors (RMSNorm alone is half a dozen of them). The layers ask `layer_ops(x)` before each such chain: it
returns the compiled kernel when `x` is a float32 CPU tensor and autograd is off (decoding; training keeps the
differentiable torch path), else None. `DFLASH_CPU_LAYER_OPS=0` turns the kernel off (the torch operations then
run, as on a machine without a compiler: a failed build is logged once and never retried).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from dflash import environment
from dflash.kernels.build import KernelUnavailable, LayerOpsKernel, load_layer_ops

__all__ = ["layer_ops", "layer_ops_enabled", "torch_layer_ops"]

log = logging.getLogger(__name__)

_kernel: LayerOpsKernel | None = None
_unavailable = False
_suspended = 0  # depth of `torch_layer_ops` blocks


def layer_ops_enabled() -> bool:
    """Whether the environment allows the fused CPU operations (`DFLASH_CPU_LAYER_OPS`, default on)."""
    return environment.cpu_layer_ops_enabled()


def layer_ops(x: torch.Tensor) -> LayerOpsKernel | None:
    """The fused CPU kernel for operations on `x`, or None where the torch operations must run."""
    global _kernel, _unavailable
    if _suspended or x.device.type != "cpu" or x.dtype != torch.float32 or torch.is_grad_enabled():
        return None
    if _kernel is not None:
        return _kernel
    if _unavailable or not layer_ops_enabled():
        return None
    try:
        _kernel = load_layer_ops()
    except KernelUnavailable as exc:
        _unavailable = True
        log.warning("fused CPU layer operations unavailable, using torch operations: %s", exc)
        return None
    return _kernel


@contextmanager
def torch_layer_ops() -> Iterator[None]:
    """Within the block the layers run their torch operations (benchmarks compare both paths in one process)."""
    global _suspended
    _suspended += 1
    try:
        yield
    finally:
        _suspended -= 1
