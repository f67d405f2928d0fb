"""`nn.Linear` stand-in whose weight is int8 with one float32 scale per output row (GPU drafters).

At batch one a product's time is its weight bytes over the memory bandwidth, so halving the bytes halves it: the
skinny program (`dflash.kernels.triton_skinny`) reads the int8 rows, widens them in registers and scales the sums
once. Symmetric per-row rounding (scale = max |w| / 127) keeps each weight within half a step of its value. Meant
for drafters: the target verifies every draft, so rounding a drafter's weights can change how many drafts are
accepted, never what is generated.

Like `QuantizedLinear`, the module keeps an empty `weight` buffer in the compute dtype, so code that asks
`module.weight.dtype` or `.device` keeps working; the weights are the `values` and `scales` buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dflash.kernels.triton_skinny import fast_linear

__all__ = ["Int8Linear", "int8_rows", "uses_int8_weights"]


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight: [out, in] float -> (values int8 [out, in], scales float32 [out]) with weight ~ values * scales."""
    wide = weight.detach().float()
    scales = wide.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0  # [out]
    values = torch.round(wide / scales[:, None]).clamp_(-127, 127).to(torch.int8)  # [out, in]
    return values.contiguous(), scales.contiguous()


class Int8Linear(nn.Module):
    """y[..., out] = x[..., in] @ (values * scales[:, None])^T (+ bias) for x in a float dtype."""

    values: torch.Tensor
    scales: torch.Tensor
    weight: torch.Tensor

    def __init__(
        self, values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        if values.dtype != torch.int8 or values.dim() != 2 or scales.shape != values.shape[:1]:
            raise ValueError("Int8Linear takes int8 values [out, in] and one scale per output row")
        self.out_features, self.in_features = values.shape
        self.register_buffer("values", values, persistent=False)
        self.register_buffer("scales", scales.to(torch.float32), persistent=False)
        self.register_buffer("weight", torch.empty(0, dtype=dtype, device=values.device), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        values, scales = int8_rows(linear.weight)
        return cls(values, scales, linear.weight.dtype, linear.bias)

    @classmethod
    def stacked(cls, parts: Sequence[Int8Linear]) -> Int8Linear:
        """One module over the parts' rows in order (fused q/k/v, gate/up); the parts' buffers become views of it,
        so the joined and separate modules share memory. Parts must be bias-free."""
        if any(part.bias is not None for part in parts):
            raise ValueError("only bias-free parts can be stacked")
        joined = cls(
            torch.cat([part.values for part in parts]), torch.cat([part.scales for part in parts]), parts[0].weight.dtype
        )
        offset = 0
        for part in parts:
            rows = part.out_features
            part.values = joined.values[offset : offset + rows]
            part.scales = joined.scales[offset : offset + rows]
            offset += rows
        return joined

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = fast_linear(x.reshape(-1, self.in_features).contiguous(), self.values, self.bias, self.scales)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 rows"


def uses_int8_weights(model: nn.Module) -> bool:
    return any(isinstance(m, Int8Linear) for m in model.modules())
