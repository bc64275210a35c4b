"""Laurel (Gemma 3n): a low-rank residual branch beside attention."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.layers.norms import RMSNorm


class Laurel(nn.Module):
    def __init__(self, hidden: int, rank: int, eps: float) -> None:
        super().__init__()
        self.linear_left = nn.Linear(hidden, rank, bias=False)
        self.linear_right = nn.Linear(rank, hidden, bias=False)
        self.post_laurel_norm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))  # type: ignore[no-any-return]
