"""Attention whose values are narrower than its keys (MiMo-V2-Flash: keys 192, values 128 per
head), scaled by `value_scale`. The KV cache stores K and V pages of one head size, so values
are stored zero-padded to the key size; the padded channels of the output are exactly zero
and are cut off before o_proj. The cost is the padding in the cache (e.g. 192 + 192 instead
of 192 + 128 per head and token), which the KV spec of such layers counts."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from hybridkv.models.layers.attention import Attention
from hybridkv.worker.forward_context import ForwardContext


class PaddedValueAttention(Attention):
    def __init__(self, *args: object, value_head_dim: int, value_scale: float = 1.0,
                 **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        s = self.shape
        if value_head_dim > s.head_dim or s.values_are_keys or self.reads_shared_kv:
            raise NotImplementedError(
                f"value head size {value_head_dim} above the key head size {s.head_dim} (or "
                f"with values = keys / KV sharing) is not supported")
        self.value_head_dim, self.value_scale = value_head_dim, value_scale
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * value_head_dim, bias=s.bias)
        self.o_proj = nn.Linear(s.num_heads * value_head_dim, s.hidden_size,
                                bias=s.bias if s.o_bias is None else s.o_bias)

    def keys_values(self, k_out: torch.Tensor | None, v_out: torch.Tensor | None
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        assert k_out is not None and v_out is not None
        k = k_out.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v_out.unflatten(-1, (self.num_kv_heads, self.value_head_dim))
        if self.value_scale != 1.0:
            v = v * self.value_scale
        return k, nn.functional.pad(v, (0, self.head_dim - self.value_head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
               gate: torch.Tensor | None, ctx: ForwardContext) -> torch.Tensor:
        params = self.params if self.sinks is None else replace(self.params, sinks=self.sinks)
        out = ctx.attention(self.name, q, k, v, params)
        return self.o_proj(out[..., :self.value_head_dim].flatten(1))  # type: ignore[no-any-return]
