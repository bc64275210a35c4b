"""Attention with an output gate from its own projection (AFMoE's `gate_proj`): one gate
logit per channel of every head, computed from the layer input:

    out = o_proj(attention(q, k, v) * sigmoid(gate_proj(h)))
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.layers.attention import Attention


class OutputGatedAttention(Attention):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gate_proj = nn.Linear(self.shape.hidden_size, self.num_heads * self.head_dim,
                                   bias=False)

    def queries(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, _ = super().queries(h)
        return q, self.gate_proj(h).unflatten(-1, (self.num_heads, self.head_dim))
