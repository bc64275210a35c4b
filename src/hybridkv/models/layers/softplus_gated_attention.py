"""Attention whose output is scaled by a softplus gate computed from the layer input
(Laguna's `g_proj`), per head (one scalar per head and token, broadcast over the head's
channels) or per channel, before o_proj:

    out = o_proj(attention(q, k, v) * softplus(g_proj(h)))
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.rotary import Rotary
from hybridkv.worker.attention.backend import AttentionParams
from hybridkv.worker.forward_context import ForwardContext


class SoftplusGatedAttention(Attention):
    def __init__(self, layer: int, shape: AttentionShape, params: AttentionParams, *,
                 rotary: Rotary | None, per_head: bool) -> None:
        super().__init__(layer, shape, params, rotary=rotary)
        self.per_head = per_head
        width = shape.num_heads * (1 if per_head else shape.head_dim)
        self.g_proj = nn.Linear(shape.hidden_size, width, bias=False)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        q, k, v, _ = self.rotated_qkv(h, positions, ctx)
        out = ctx.attention(self.name, q, k, v, self.attention_params(ctx))  # [T, H, D]
        # The softplus in float32, as the reference computes it, then the output's dtype.
        gate = nn.functional.softplus(self.g_proj(h).float()).to(out.dtype)
        gate = gate[:, :, None] if self.per_head else gate.unflatten(-1, (self.num_heads, -1))
        return self.o_proj((out * gate).flatten(1))  # type: ignore[no-any-return]
