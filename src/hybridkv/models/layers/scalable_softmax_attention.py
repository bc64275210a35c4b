"""Beam's attention: per-head q/k norms; RoPE, or on NoPE layers queries scaled up with
position ("scalable softmax": q *= (1 + (position + 1) / 2048) ** 0.1, computed as the
reference does, exp(0.1 * log1p(.)), in float32); a sigmoid output gate per channel from its
own projection plus a learned bias per head:

    out = o_proj(attention(q, k, v) * sigmoid(gate_proj(h) + gate_bias[head]))
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.rotary import Rotary
from hybridkv.worker.attention.backend import AttentionParams
from hybridkv.worker.forward_context import ForwardContext

SCALABLE_SOFTMAX_LENGTH = 2048.0


class ScalableSoftmaxAttention(Attention):
    def __init__(self, layer: int, shape: AttentionShape, params: AttentionParams, *,
                 rotary: Rotary | None) -> None:
        super().__init__(layer, shape, params, rotary=rotary)
        self.gate_proj = nn.Linear(shape.hidden_size, shape.num_heads * shape.head_dim,
                                   bias=False)
        self.gate_bias = nn.Parameter(torch.zeros(shape.num_heads))

    def rotated_qkv(self, h: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                               torch.Tensor | None]:
        q, k, v, _ = super().rotated_qkv(h, positions, ctx)
        if self.rotary is None:
            scale = torch.exp(0.1 * torch.log1p((positions.float() + 1) /
                                                SCALABLE_SOFTMAX_LENGTH))  # [T]
            q = (q.float() * scale[:, None, None]).to(q.dtype)
        # [T, heads, head_dim]: `output` takes its sigmoid.
        gate = self.gate_proj(h).unflatten(-1, (self.num_heads, -1)) + self.gate_bias[:, None]
        return q, k, v, gate
