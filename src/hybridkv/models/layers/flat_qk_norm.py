"""Attention whose q and k norms span all heads of the projection at once (OLMo 2/3: an
RMSNorm over num_heads * head_dim, before the split into heads), not each head apart."""

from __future__ import annotations

import torch

from hybridkv.models.layers.attention import Attention
from hybridkv.models.layers.norms import RMSNorm


class FlatQKNormAttention(Attention):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        if self.shape.qk_norm or self.reads_shared_kv:
            raise ValueError("FlatQKNormAttention: give a shape without per-head q/k norms, "
                             "and no KV sharing")
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, self.shape.eps)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, self.shape.eps)

    def queries(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.q_norm is not None
        return self.q_norm(self.q_proj(h)).unflatten(-1, (self.num_heads, -1)), None

    def keys_values(self, h: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        assert self.k_norm is not None and self.k_proj is not None and self.v_proj is not None
        k = self.k_norm(self.k_proj(h)).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return k, self.v_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim))
