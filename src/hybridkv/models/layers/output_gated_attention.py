"""Attention with an output gate from its own projection (AFMoE's `gate_proj`): one gate
logit per channel of every head, computed from the layer input:

    out = o_proj(attention(q, k, v) * sigmoid(gate_proj(h)))
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.layers.attention import Attention
from hybridkv.worker.forward_context import ForwardContext


class OutputGatedAttention(Attention):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gate_proj = nn.Linear(self.shape.hidden_size, self.num_heads * self.head_dim,
                                   bias=False)

    def rotated_qkv(self, h: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                               torch.Tensor | None]:
        q, k, v, _ = super().rotated_qkv(h, positions, ctx)
        return q, k, v, self.gate_proj(h).unflatten(-1, (self.num_heads, self.head_dim))
