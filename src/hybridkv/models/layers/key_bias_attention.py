"""Attention with a learned bias per key (Doge's dynamic mask): each key token adds
b = exp(A[kv head] * softplus(dt_proj(v))) to every logit it takes part in,

    logits = (q . k) * scale + b_key

carried in the cache as one more key channel: keys are stored [k | b / scale] and queries
read [q | 1], values zero-padded to the same head size (the padded output channel is
exactly zero and cut off before o_proj). The cost is one channel of K and V per head and
token, which the KV spec of such layers counts (layer_mix: head size + 1).

Doge keeps only the `keep_window_size` keys of largest bias per query once more keys than
that are visible; up to that many visible keys the selection keeps them all, so this layer
refuses positions past it (full-attention layers) instead of attending to more keys."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.rotary import Rotary
from hybridkv.worker.attention.backend import AttentionParams
from hybridkv.worker.forward_context import ForwardContext


class KeyBiasAttention(Attention):
    def __init__(self, layer: int, shape: AttentionShape, params: AttentionParams, *,
                 rotary: Rotary | None, keep_window_size: int) -> None:
        super().__init__(layer, shape, params, rotary=rotary)
        self.A = nn.Parameter(torch.zeros(shape.num_kv_heads))
        self.dt_proj = nn.Linear(shape.num_kv_heads * shape.head_dim, shape.num_kv_heads,
                                 bias=shape.bias)
        window = params.sliding_window
        # The most keys a query can see: the window, or unbounded for a full layer.
        self.max_position = None if window is not None and window <= keep_window_size \
            else keep_window_size
        self.keep_window_size = keep_window_size

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        if self.max_position is not None and positions.numel() and \
                int(positions.max()) >= self.max_position:
            raise NotImplementedError(
                f"doge: a query past keep_window_size={self.keep_window_size} keys selects "
                f"its keys dynamically (top-k by bias), which is not supported; keep "
                f"max_model_len <= {self.keep_window_size}")
        q, k, v, _ = self.rotated_qkv(h, positions, ctx)
        assert k is not None and v is not None
        # [T, Hk]: each key's bias, from its values.
        b = torch.exp(self.A * nn.functional.softplus(self.dt_proj(v.flatten(1))))
        scale = self.params.scale
        q = nn.functional.pad(q, (0, 1), value=1.0)
        k = torch.cat([k, (b / scale)[:, :, None].to(k.dtype)], dim=-1)
        v = nn.functional.pad(v, (0, 1))
        out = ctx.attention(self.name, q, k, v, self.params)
        return self.o_proj(out[..., :self.head_dim].flatten(1))  # type: ignore[no-any-return]
