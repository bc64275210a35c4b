"""Falcon-H1: every layer runs attention and Mamba2 side by side on the same normalised
input and adds both, then a SwiGLU MLP; µP multipliers on embeddings, both branches' inputs
and outputs, keys, the MLP and the logits."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.bamba import PartialRopeAttention
from hybridkv.models.layers import ForwardContext, RMSNorm, activation
from hybridkv.models.mamba2 import Mamba2Mixer
from hybridkv.models.weights import load_named_weights


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
        name = self.mamba.name
        ssm = self.mamba(x, ctx.metadata[ctx.layer_group[name]], ctx.kv_caches[name])
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


class FalconH1ForCausalLM(nn.Module):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.model = FalconH1Model(config)
        self.lm_head = nn.Linear(int(config["hidden_size"]), int(config["vocab_size"]),
                                 bias=False)
        self.tied = bool(config.get("tie_word_embeddings", False))
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.embedding_multiplier = float(config.get("embedding_multiplier", 1.0))
        self.lm_head_multiplier = float(config.get("lm_head_multiplier", 1.0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids) * self.embedding_multiplier
        for layer in self.model.layers:
            h = layer(h, positions, ctx)
        return self.model.final_layernorm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) * self.lm_head_multiplier

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights, model_type="falcon_h1", tied=self.tied)
