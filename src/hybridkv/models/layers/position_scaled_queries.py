"""Attention whose queries grow with position after RoPE (Ministral 3's "Llama 4 scaling"):
q *= 1 + beta * log(1 + floor(position / original_max_position_embeddings)), so attention
stays sharp past the length the model was trained at."""

from __future__ import annotations

import torch

from hybridkv.models.layers.attention import Attention
from hybridkv.worker.forward_context import ForwardContext


class PositionScaledQueryAttention(Attention):
    def __init__(self, *args: object, beta: float, original_length: int,
                 **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.beta, self.original_length = beta, original_length

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        q, k, v, gate = self.rotated_qkv(h, positions, ctx)
        scale = 1 + self.beta * torch.log1p(torch.floor(positions.float() / self.original_length))
        q = q * scale.view(-1, 1, 1).to(q.dtype)
        return self.attend(q, k, v, gate, ctx)
