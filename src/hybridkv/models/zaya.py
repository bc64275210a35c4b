"""Zaya: every layer is CCA attention (layers/cca_attention.py), full ("hybrid") or sliding
("hybrid_sliding"), with RoPE per layer type on part of each head, then a top-1 MoE whose
router carries a hidden state from layer to layer:

    h = (embed + input_hidden_states_bias) * input_hidden_states_scale      (float32)
    per layer: h = S1(attn(norm1(h)), h);  h = S2(moe(norm2(h)), h)
               S(x, h) = (x + hidden_states_bias) * hidden_states_scale
                         + (h + residual_bias) * residual_scale
    router:    s = down_proj(x) (+ the previous layer's s x router_states_scale, from
               layer 1 on); p = softmax(router_mlp(s)) over the experts and one skip
               class; the top-1 of p + balancing_biases; a skip chosen adds nothing

The router state rides beside the residual stream: between layers h is [T, hidden + router]."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import SLIDING
from hybridkv.models.layers.cca_attention import CCAAttention
from hybridkv.models.layers.moe import StackedExperts, act_glu
from hybridkv.models.layers.norms import RMSNorm
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.text_config import TextConfig
from hybridkv.worker.attention.backend import AttentionParams
from hybridkv.worker.forward_context import ForwardContext


class ResidualScaling(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.hidden_states_scale = nn.Parameter(torch.ones(hidden))
        self.hidden_states_bias = nn.Parameter(torch.zeros(hidden))
        self.residual_scale = nn.Parameter(torch.ones(hidden))
        self.residual_bias = nn.Parameter(torch.zeros(hidden))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return (x + self.hidden_states_bias) * self.hidden_states_scale + \
            (residual + self.residual_bias) * self.residual_scale


class RouterMLP(nn.Module):
    def __init__(self, width: int, num_classes: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(width, eps)
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)
        self.out_proj = nn.Linear(width, num_classes, bias=False)

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        gelu = nn.functional.gelu
        return self.out_proj(gelu(self.fc2(gelu(self.fc1(self.norm(s))))))  # type: ignore[no-any-return]


class Router(nn.Module):
    """(x [T, hidden], previous state [T, router] or None) -> (weights [T, k], expert ids
    [T, k], this layer's state)."""

    def __init__(self, hidden: int, width: int, num_experts: int, top_k: int, eps: float, *,
                 carries: bool) -> None:
        super().__init__()
        self.down_proj = nn.Linear(hidden, width)
        self.router_states_scale = nn.Parameter(torch.ones(width)) if carries else None
        self.router_mlp = RouterMLP(width, num_experts + 1, eps)
        bias = torch.zeros(num_experts + 1)
        bias[-1] = -1.0
        # A parameter (not a buffer) so the loader finds it under its checkpoint name.
        self.balancing_biases = nn.Parameter(bias, requires_grad=False)
        self.num_experts, self.top_k = num_experts, top_k

    def forward(self, x: torch.Tensor, state: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.down_proj(x)
        if self.router_states_scale is not None and state is not None:
            s = s + state * self.router_states_scale
        probs = torch.softmax(self.router_mlp(s), dim=-1)
        ids = torch.topk(probs.float() + self.balancing_biases.float(), self.top_k, dim=-1)[1]
        weights = probs.gather(1, ids)
        skip = ids == self.num_experts  # the skip class: weight 0 on expert 0
        return weights.masked_fill(skip, 0), ids.masked_fill(skip, 0), s


class ZayaMoE(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int) -> None:
        super().__init__()
        raw = cfg.raw
        num_experts = int(raw["num_experts"])
        self.gate = Router(cfg.hidden_size, int(raw.get("router_hidden_size") or 256),
                           num_experts, int(raw.get("num_experts_per_tok") or 1),
                           cfg.rms_norm_eps, carries=layer != 0)
        self.experts = StackedExperts(num_experts, cfg.hidden_size,
                                      int(raw["moe_intermediate_size"]), act_glu(cfg.hidden_act))

    def forward(self, x: torch.Tensor, state: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids, state = self.gate(x, state)
        return self.experts(x, weights.to(x.dtype), ids), state


class ZayaLayer(nn.Module):
    """forward([T, hidden + router] stream, positions, ctx) -> the same."""

    def __init__(self, cfg: TextConfig, layer: int, kind: str) -> None:
        super().__init__()
        raw, hidden = cfg.raw, cfg.hidden_size
        layer_type = "hybrid_sliding" if kind == SLIDING else "hybrid"
        rope = (raw.get("rope_parameters") or {}).get(layer_type) or {"rope_type": "default"}
        params = AttentionParams(scale=cfg.head_dim ** -0.5,
                                 sliding_window=cfg.sliding_window if kind == SLIDING else None)
        self.self_attn = CCAAttention(
            layer, hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, params,
            rotary=Rotary(cfg.head_dim, rope), bias=cfg.attention_bias,
            kernels=(int(raw.get("cca_time0", 2)), int(raw.get("cca_time1", 2))))
        self.mlp = ZayaMoE(cfg, layer)
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.post_attention_residual_scale = ResidualScaling(hidden)
        self.post_mlp_residual_scale = ResidualScaling(hidden)
        self.hidden, self.first = hidden, layer == 0

    def forward(self, stream: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        h, state = stream[:, :self.hidden], stream[:, self.hidden:]
        x = self.self_attn(self.input_layernorm(h), positions, ctx)
        h = self.post_attention_residual_scale(x, h)
        x, state = self.mlp(self.post_attention_layernorm(h), None if self.first else state)
        return torch.cat([self.post_mlp_residual_scale(x, h), state], dim=-1)


class ZayaForCausalLM(CausalLM):
    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config, eps=1e-5, tied=True)
        kinds = [parts[0] for parts in cfg.layer_kinds]
        super().__init__(cfg, (ZayaLayer(cfg, i, k) for i, k in enumerate(kinds)))
        self.model.input_hidden_states_scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.model.input_hidden_states_bias = nn.Parameter(torch.zeros(cfg.hidden_size))
        if cfg.raw.get("lm_head_bias"):
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=True)
            if cfg.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens.weight
        self.router_width = int(cfg.raw.get("router_hidden_size") or 256)

    def enter_layers(self, h: torch.Tensor) -> torch.Tensor:
        bias = cast(torch.Tensor, self.model.input_hidden_states_bias)
        scale = cast(torch.Tensor, self.model.input_hidden_states_scale)
        h = ((h + bias) * scale).float()
        return torch.cat([h, h.new_zeros(h.shape[0], self.router_width)], dim=-1)

    def leave_layers(self, h: torch.Tensor) -> torch.Tensor:
        return h[:, :self.cfg.hidden_size]
