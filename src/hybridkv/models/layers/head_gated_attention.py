"""Attention whose heads are each scaled by a sigmoid gate computed from the layer input
(LFM3's `g_proj`: one scalar per head and token), before o_proj:

    out = o_proj(attention(q, k, v) * sigmoid(g_proj(h))[..., None])
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.rotary import Rotary
from hybridkv.worker.attention.backend import AttentionParams
from hybridkv.worker.forward_context import ForwardContext


class HeadGatedAttention(Attention):
    def __init__(self, layer: int, shape: AttentionShape, params: AttentionParams, *,
                 rotary: Rotary | None) -> None:
        super().__init__(layer, shape, params, rotary=rotary)
        self.g_proj = nn.Linear(shape.hidden_size, shape.num_heads, bias=False)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        q, k, v, _ = self.rotated_qkv(h, positions, ctx)
        # `attend` multiplies by the sigmoid of a per-channel gate: the head's gate logit,
        # repeated over the head's channels ([T, heads] -> [T, heads, head_dim]).
        gate = self.g_proj(h)[:, :, None].expand(-1, -1, self.head_dim)
        return self.attend(q, k, v, gate, ctx)
