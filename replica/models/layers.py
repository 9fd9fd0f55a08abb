"""Weight-holding building blocks. Parameters start uninitialised: the loader fills them.

torch.empty instead of nn.Linear's random init keeps construction of a large model cheap;
the loader checks that every parameter was written.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T + b with W: [out, in], HF's layout.

    On CPU the runner may set `packed`, the weight in oneDNN's blocked layout
    (replica/cpu_linear.py); the forward then runs oneDNN's matmul on it instead of F.linear.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype, device=device)
        self.bias = _param(out_features, dtype=dtype, device=device) if bias else None
        self.packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = _param(num_embeddings, dim, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        return F.embedding(ids, self.weight)


class RMSNormWeight(nn.Module):
    """Only the weight and eps; the computation is ops.rms_norm / ops.fused_add_rms_norm."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.weight = _param(dim, dtype=dtype, device=device)
        self.eps = eps
