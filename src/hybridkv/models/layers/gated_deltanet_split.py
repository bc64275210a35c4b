"""Gated DeltaNet with its input projections stored apart (Qwen3.5): `in_proj_qkv` yields
[all q | all k | all v], `in_proj_z`, `in_proj_b` and `in_proj_a` the gate, beta and decay
inputs, instead of Qwen3-Next's two projections grouped per key head. The recurrence, the
state and the gated norm are GatedDeltaNet's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.layers.gated_deltanet import GatedDeltaNet


class SplitGatedDeltaNet(GatedDeltaNet):
    def __init__(self, cfg: Mapping[str, Any], layer: int) -> None:
        super().__init__(cfg, layer)
        hidden = int(cfg["hidden_size"])
        del self.in_proj_qkvz, self.in_proj_ba
        self.in_proj_qkv = nn.Linear(hidden, 2 * self.key_size + self.value_size, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_size, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        # GatedDeltaNet.forward hands `_split` what its two projections return; here they
        # pass the hidden states through and `_split` projects (so every other step, and
        # any faster path the parent gains, stays the parent's).
        self.in_proj_qkvz = self.in_proj_ba = nn.Identity()

    def _split(self, h: torch.Tensor, _: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = self.in_proj_qkv(h).split([self.key_size, self.key_size, self.value_size],
                                            dim=-1)
        z = self.in_proj_z(h).unflatten(-1, (self.num_v_heads, self.v_dim))
        return q, k, v, z, self.in_proj_b(h), self.in_proj_a(h)
