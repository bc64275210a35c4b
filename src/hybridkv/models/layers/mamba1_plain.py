"""The Mamba1 mixer as the original Mamba and Falcon-Mamba write it: Jamba's mixer
(layers/mamba1.py) without its learned dt/B/C norms. Mamba has none; Falcon-Mamba
RMS-normalises dt, B and C with no weight (`mixer_rms_eps`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.layers.mamba1 import Mamba1Mixer
from hybridkv.models.layers.norms import rms_normalize


class ScaleFreeRMSNorm(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Spelled out (not the fused op), as the reference computes it.
        return rms_normalize(x, self.eps, fused=False)


def mixer_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A Mamba/Falcon-Mamba config in the field names Mamba1Mixer reads (Jamba's). The inner
    width is `intermediate_size` where saved: Falcon-Mamba-7B's config says expand 16 but
    its weights (and transformers, which keeps a saved intermediate_size) are 2x hidden."""
    hidden = int(cfg["hidden_size"])
    inner = int(cfg.get("intermediate_size") or int(cfg.get("expand", 2)) * hidden)
    if inner % hidden:
        raise ValueError(f"intermediate_size ({inner}) must be a multiple of hidden_size "
                         f"({hidden}) for a Mamba mixer")
    return dict(hidden_size=hidden, mamba_expand=inner // hidden,
                mamba_d_state=cfg.get("state_size", 16), mamba_d_conv=cfg.get("conv_kernel", 4),
                mamba_dt_rank=cfg.get("time_step_rank"), mamba_proj_bias=cfg.get("use_bias", False),
                mamba_conv_bias=cfg.get("use_conv_bias", True),
                hidden_act=cfg.get("hidden_act", "silu"))


class PlainMamba1Mixer(Mamba1Mixer):
    """`norm_eps`: None for Mamba (dt, B, C as projected), the weightless norms' eps for
    Falcon-Mamba."""

    def __init__(self, cfg: Mapping[str, Any], layer: int, *, norm_eps: float | None) -> None:
        super().__init__(mixer_config(cfg), layer)
        norm = nn.Identity() if norm_eps is None else ScaleFreeRMSNorm(norm_eps)
        self.dt_layernorm = self.b_layernorm = self.c_layernorm = norm
