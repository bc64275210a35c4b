"""Gated DeltaNet as OLMo Hybrid writes it: one projection per input (`q_proj`, `k_proj`,
`v_proj`, the output gate `g_proj`, beta's `b_proj` and the decay's `a_proj`), `o_norm` and
`o_proj` after the recurrence, beta scaled by 2 when `linear_allow_neg_eigval` (the default)
and the gated output norm at eps 1e-5 whatever `rms_norm_eps` says. The recurrence, the conv
over [q | k | v] and the state are GatedDeltaNet's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.layers.gated_deltanet import GatedDeltaNet, HeadNormWeight, gated_head_norm


class OlmoGatedDeltaNet(GatedDeltaNet):
    def __init__(self, cfg: Mapping[str, Any], layer: int) -> None:
        super().__init__(cfg, layer,
                         beta_scale=2.0 if cfg.get("linear_allow_neg_eigval", True) else 1.0,
                         norm_eps=1e-5)
        hidden = int(cfg["hidden_size"])
        del self.in_proj_qkvz, self.in_proj_ba, self.out_proj, self.norm
        self.q_proj = nn.Linear(hidden, self.key_size, bias=False)
        self.k_proj = nn.Linear(hidden, self.key_size, bias=False)
        self.v_proj = nn.Linear(hidden, self.value_size, bias=False)
        self.g_proj = nn.Linear(hidden, self.value_size, bias=False)
        self.a_proj = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.o_norm = HeadNormWeight(self.v_dim)
        self.o_proj = nn.Linear(self.value_size, hidden, bias=False)
        # As in SplitGatedDeltaNet: the parent's two projections pass the hidden states
        # through and `_split` projects, so the parent's steps stay the parent's.
        self.in_proj_qkvz = self.in_proj_ba = nn.Identity()

    def _split(self, h: torch.Tensor, _: torch.Tensor) -> tuple[torch.Tensor, ...]:
        z = self.g_proj(h).unflatten(-1, (self.num_v_heads, self.v_dim))
        return self.q_proj(h), self.k_proj(h), self.v_proj(h), z, self.b_proj(h), \
            self.a_proj(h)

    def _output(self, out: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.o_proj(  # type: ignore[no-any-return]
            gated_head_norm(out, z, self.o_norm.weight, self.eps, dtype))
