"""Host tensors to the device without waiting for it.

A plain `tensor.to("cuda")` from pageable memory synchronises with the stream: the host waits for every kernel queued
before the copy. The engine loop keeps a round queued on the GPU while it does its host work (`dflash.batch.overlap`,
`dflash.batch.device_trees`), so one such copy (a block table growing, a context's positions) empties that queue and
leaves the GPU idle until the next launch. A copy from pinned memory with `non_blocking=True` is queued like a
kernel; torch's caching host allocator keeps the pinned buffer until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU through pinned memory, queued without waiting for the device."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
