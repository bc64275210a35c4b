"""Falcon-H1: every layer runs attention and Mamba2 side by side on the same normalised
input and adds both, then a SwiGLU MLP; µP multipliers on embeddings, both branches' inputs
and outputs, keys, the MLP and the logits."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.bamba import PartialRopeAttention
from hybridkv.models.base import CausalLM
from hybridkv.models.layers import RMSNorm, activation
from hybridkv.models.mamba2 import Mamba2Mixer
from hybridkv.worker.forward_context import ForwardContext


class FalconMLP(nn.Module):
    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        bias = bool(cfg.get("mlp_bias", False))
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act = activation(str(cfg.get("hidden_act", "silu")))
        self.gate_multiplier, self.down_multiplier = (
            float(m) for m in cfg.get("mlp_multipliers") or (1.0, 1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up_proj(x) * self.act(self.gate_proj(x) * self.gate_multiplier)
        return self.down_proj(y) * self.down_multiplier


class FalconH1Layer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], layer: int) -> None:
        super().__init__()
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-5))
        self.mamba = Mamba2Mixer(cfg, layer)
        self.self_attn = PartialRopeAttention(
            cfg, layer, key_multiplier=float(cfg.get("key_multiplier", 1.0)))
        self.feed_forward = FalconMLP(cfg)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.pre_ff_layernorm = RMSNorm(hidden, eps)
        self.attn_in = float(cfg.get("attention_in_multiplier", 1.0))
        self.attn_out = float(cfg.get("attention_out_multiplier", 1.0))
        self.ssm_out = float(cfg.get("ssm_out_multiplier", 1.0))

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        x = self.input_layernorm(h)
        ssm = self.mamba(x, ctx)
        attn = self.self_attn(x * self.attn_in, positions, ctx)
        h = h + ssm * self.ssm_out + attn * self.attn_out
        return h + self.feed_forward(self.pre_ff_layernorm(h))


class FalconH1Model(nn.Module):
    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        hidden = int(cfg["hidden_size"])
        self.embed_tokens = nn.Embedding(int(cfg["vocab_size"]), hidden)
        self.layers = nn.ModuleList(FalconH1Layer(cfg, i)
                                    for i in range(int(cfg["num_hidden_layers"])))
        self.final_layernorm = RMSNorm(hidden, float(cfg.get("rms_norm_eps", 1e-5)))


class FalconH1ForCausalLM(CausalLM):
    model_type = "falcon_h1"
    norm_name = "final_layernorm"

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config, FalconH1Model(config))
