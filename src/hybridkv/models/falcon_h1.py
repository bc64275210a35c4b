"""Falcon-H1: every layer runs attention and Mamba2 side by side on the same normalised
input and adds both, then a SwiGLU MLP; µP multipliers on embeddings, both branches' inputs
and outputs, keys, the MLP and the logits."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import FULL
from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.mamba2 import Mamba2Mixer
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.norms import RMSNorm
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.text_config import TextConfig
from hybridkv.worker.attention.backend import AttentionParams
from hybridkv.worker.forward_context import ForwardContext


class FalconH1Layer(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int) -> None:
        super().__init__()
        raw, hidden, eps = cfg.raw, cfg.hidden_size, cfg.rms_norm_eps
        self.mamba = Mamba2Mixer(raw, layer)
        self.self_attn = Attention(
            layer, AttentionShape.from_config(
                cfg, key_multiplier=float(raw.get("key_multiplier", 1.0))),
            AttentionParams(scale=cfg.head_dim ** -0.5),
            rotary=Rotary.from_config(raw, cfg.head_dim, FULL))
        gate_multiplier, down_multiplier = (float(m) for m in raw.get("mlp_multipliers")
                                            or (1.0, 1.0))
        self.feed_forward = GatedMLP(hidden, cfg.intermediate_size, cfg.hidden_act,
                                     bias=bool(raw.get("mlp_bias", False)),
                                     multipliers=(gate_multiplier, down_multiplier))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.pre_ff_layernorm = RMSNorm(hidden, eps)
        self.attn_in = float(raw.get("attention_in_multiplier", 1.0))
        self.attn_out = float(raw.get("attention_out_multiplier", 1.0))
        self.ssm_out = float(raw.get("ssm_out_multiplier", 1.0))

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        x = self.input_layernorm(h)
        ssm = self.mamba(x, positions, ctx)
        attn = self.self_attn(x * self.attn_in, positions, ctx)
        h = h + ssm * self.ssm_out + attn * self.attn_out
        return h + self.feed_forward(self.pre_ff_layernorm(h))  # type: ignore[no-any-return]


class FalconH1ForCausalLM(CausalLM):
    norm_name = "final_layernorm"

    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config, eps=1e-5)
        super().__init__(cfg, (FalconH1Layer(cfg, i) for i in range(cfg.num_layers)))
