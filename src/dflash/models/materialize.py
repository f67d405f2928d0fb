"""Models built on the meta device (their shapes only) given real, uninitialised storage before their weights load.

`nn.Module.to_empty` would do it, but for meta tensors torch computes each empty tensor's layout through its reference
ops, whose first use imports its symbolic-shape machinery (sympy and torch.fx, tens of MiB of resident memory that
a CPU engine otherwise never loads). Here each meta tensor is replaced by `torch.empty` of its shape and dtype.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

__all__ = ["materialize"]

M = TypeVar("M", bound=nn.Module)


def materialize(module: M, device: torch.device | str, recurse: bool = True) -> M:
    """Gives every parameter and buffer of `module` (and, with `recurse`, of its submodules) that is still on the
    meta device uninitialised storage on `device`, keeping its shape, dtype and `requires_grad`; returns `module`.
    Tensors already on a real device stay as they are; a parameter shared by two modules stays shared."""
    made: dict[int, nn.Parameter] = {}
    for owner in module.modules() if recurse else [module]:
        for name, parameter in list(owner._parameters.items()):
            if parameter is not None and parameter.is_meta:
                if id(parameter) not in made:
                    empty = torch.empty(parameter.shape, dtype=parameter.dtype, device=device)
                    made[id(parameter)] = nn.Parameter(empty, requires_grad=parameter.requires_grad)
                owner._parameters[name] = made[id(parameter)]
        for name, buffer in list(owner._buffers.items()):
            if buffer is not None and buffer.is_meta:
                owner._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
    return module
