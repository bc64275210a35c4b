"""Doge: Llama-shaped layers (every layer sliding when the config gives a `sliding_window`)
whose attention adds a learned bias per key (layers/key_bias_attention.py), with per-head
q/k norms and residuals scaled per channel:

    h = input_residual * h + attn(input_layernorm(h))
    h = post_attention_residual * h + mlp(post_attention_layernorm(h))

Not supported: the cross-domain MoE (`is_moe`), whose routing mixes tokens of a forward
pass with each other (transformers notes it is not causal in prefill)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import SLIDING
from hybridkv.models.layers.attention import AttentionShape
from hybridkv.models.layers.key_bias_attention import KeyBiasAttention
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.norms import RMSNorm
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.text_config import TextConfig
from hybridkv.worker.attention.backend import AttentionParams
from hybridkv.worker.forward_context import ForwardContext


class DogeLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int, kind: str) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.self_attn = KeyBiasAttention(
            layer, AttentionShape.from_config(cfg, qk_norm=True),
            AttentionParams(scale=cfg.head_dim ** -0.5,
                            sliding_window=cfg.sliding_window if kind == SLIDING else None),
            rotary=Rotary.from_config(cfg.raw, cfg.head_dim, kind),
            keep_window_size=int(cfg.raw.get("keep_window_size") or 2048))
        self.mlp = GatedMLP(hidden, cfg.intermediate_size, cfg.hidden_act,
                            bias=bool(cfg.raw.get("mlp_bias", False)))
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.input_residual = nn.Parameter(torch.ones(hidden))
        self.post_attention_residual = nn.Parameter(torch.ones(hidden))

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        h = self.input_residual * h + self.self_attn(self.input_layernorm(h), positions, ctx)
        return self.post_attention_residual * h + self.mlp(self.post_attention_layernorm(h))  # type: ignore[no-any-return]


class DogeForCausalLM(CausalLM):
    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config)
        if cfg.raw.get("is_moe"):
            raise NotImplementedError(
                "doge: is_moe (the cross-domain MoE) is not supported: its routing mixes "
                "the tokens of a forward pass; supported: is_moe false")
        super().__init__(cfg, (DogeLayer(cfg, i, k)
                               for i, k in enumerate(cfg.attention_kinds())))
