"""A decoder layer whose residual adds are weighted by depth (Beam): the n-th add of the
model (n = 2 * layer + 2 for attention, + 1 for the MLP) keeps the stream's scale,

    h = sublayer_out / sqrt(n) + h * sqrt((n - 1) / n)

with sandwich norms around both sublayers (names as in DecoderLayer)."""

from __future__ import annotations

import math

import torch

from hybridkv.models.layers.decoder_layer import DecoderLayer
from hybridkv.worker.forward_context import ForwardContext


class DepthScaledDecoderLayer(DecoderLayer):
    def __init__(self, *args: object, layer: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.attn_add, self.ffn_add = 2 * (layer + 1), 2 * (layer + 1) + 1

    @staticmethod
    def _add(x: torch.Tensor, residual: torch.Tensor, n: int) -> torch.Tensor:
        return x * (1.0 / math.sqrt(n)) + residual * math.sqrt((n - 1) / n)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        n = self.names
        assert n.mixer is not None and n.ffns
        x = getattr(self, n.mixer)(self._norm(n.mixer_norm, h), positions, ctx)
        h = self._add(self._norm(n.post_mixer_norm, x), h, self.attn_add)
        x = getattr(self, n.ffns[0])(self._norm(n.ffn_norm, h))
        return self._add(self._norm(n.post_ffn_norm, x), h, self.ffn_add)
