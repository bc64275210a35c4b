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

    def queries(self, q_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.q_norm is not None
        return self.q_norm(q_out).unflatten(-1, (self.num_heads, -1)), None

    def keys_values(self, k_out: torch.Tensor | None, v_out: torch.Tensor | None
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        assert self.k_norm is not None and k_out is not None and v_out is not None
        k = self.k_norm(k_out).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return k, v_out.unflatten(-1, (self.num_kv_heads, self.head_dim))
