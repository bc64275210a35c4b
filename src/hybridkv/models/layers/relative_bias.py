"""Inkling's relative position bias, conditioned on the query token: `proj` is a bank of
d_rel bias-vs-distance profiles over distances 0..E-1, and each query's relative states
r [H, d_rel] mix them into one bias per head and backward distance:

    table[t, h, d] = sum_i r[t, h, i] * proj[i, d]          # [T, H, E]

The attention adds table[t, h, p - j] to the score of the key at j for the query at p
(zero when p - j >= E): AttentionParams.query_bias, worker/attention/scored.py."""

from __future__ import annotations

import torch
from torch import nn


class RelativeLogits(nn.Module):
    def __init__(self, d_rel: int, extent: int) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.zeros(d_rel, extent))

    def forward(self, relative_states: torch.Tensor) -> torch.Tensor:
        """relative_states [T, H, d_rel] -> the bias table [T, H, E]."""
        return relative_states @ self.proj


def log_scale(positions: torch.Tensor, alpha: float, n_floor: float) -> torch.Tensor:
    """[T, 1, 1] float32: 1 + alpha log(max((p + 1) / n_floor, 1)), the factor Inkling's full
    layers scale queries and relative states by at long positions."""
    tau = 1.0 + alpha * torch.log(((positions + 1).float() / n_floor).clamp(min=1.0))
    return tau[:, None, None]
