"""Gemma 4 text: sandwich-norm decoder layers with per-layer inputs, KV sharing, optional MoE.

What differs from Gemma 3n (whose attention and per-layer inputs it shares): no AltUp or
Laurel; full-attention layers have their own head size and KV heads (`per_layer_config`),
may take values equal to keys (`attention_k_eq_v`: K-only pages, K and V derived from the raw
keys at each read) and use "proportional" RoPE; layers that
read shared KV may have a double-width MLP; an MoE block can run next to the MLP, routed on
the residual stream; each layer's output is scaled by a stored `layer_scalar`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import FULL, SLIDING, attention_shape, values_are_keys
from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.moe import Routing, StackedExperts, act_glu, route
from hybridkv.models.layers.norms import RMSNorm, rms_normalize
from hybridkv.models.layers.per_layer_inputs import PerLayerInputLayer, PerLayerInputsModel
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.text_config import TextConfig
from hybridkv.models.weights import MULTIMODAL_PARTS
from hybridkv.worker.attention.backend import AttentionParams
from hybridkv.worker.forward_context import ForwardContext


class Router(nn.Module):
    """Softmax over experts of a scale-free-normed, rescaled input; top-k renormalised and
    multiplied by a learned per-expert scale."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))
        self.routing = Routing(top_k, "softmax", renormalize=True)
        self.eps, self.root = eps, hidden ** -0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.proj(rms_normalize(x, self.eps) * self.scale * self.root)
        weights, experts = route(scores, self.routing, torch.float32)
        return weights * self.per_expert_scale[experts], experts


class Gemma4DecoderLayer(PerLayerInputLayer):
    def __init__(self, cfg: TextConfig, layer: int, kind: str) -> None:
        super().__init__()
        raw, hidden, eps, act = cfg.raw, cfg.hidden_size, cfg.rms_norm_eps, cfg.hidden_act
        reads_shared_kv = layer in cfg.kv_targets
        num_kv_heads, head_dim = attention_shape(raw, layer, kind)
        shape = AttentionShape.from_config(
            cfg, num_kv_heads=num_kv_heads, head_dim=head_dim, qk_norm=True, value_norm=True,
            values_are_keys=values_are_keys(raw, cfg.model_type, kind))
        self.self_attn = Attention(
            layer, shape, AttentionParams(
                scale=1.0, sliding_window=cfg.sliding_window if kind == SLIDING else None),
            rotary=Rotary.from_config(raw, head_dim, kind), reads_shared_kv=reads_shared_kv)
        wide = 2 if raw.get("use_double_wide_mlp") and reads_shared_kv else 1
        self.mlp = GatedMLP(hidden, cfg.intermediate_size * wide, act)
        norms = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"]
        self.moe = bool(raw.get("enable_moe_block"))
        if self.moe:
            num_experts = int(raw["num_experts"])
            self.router = Router(hidden, num_experts, int(raw["top_k_experts"]), eps)
            self.experts = StackedExperts(num_experts, hidden, int(raw["moe_intermediate_size"]),
                                          act_glu(act))
            norms += ["post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                      "pre_feedforward_layernorm_2"]
        for norm in norms:
            self.add_module(norm, RMSNorm(hidden, eps))
        per_layer = int(raw.get("hidden_size_per_layer_input") or 0)
        if per_layer:
            self.init_per_layer_input(hidden, per_layer, act, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))  # a buffer in the checkpoint

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                per_layer_input: torch.Tensor | None = None) -> torch.Tensor:
        h = h + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(h), positions, ctx))
        out = self.mlp(self.pre_feedforward_layernorm(h))
        if self.moe:
            weights, experts = self.router(h)  # routed on the residual stream
            moe = self.experts(self.pre_feedforward_layernorm_2(h), weights, experts)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(moe)
        h = h + self.post_feedforward_layernorm(out)
        if per_layer_input is not None:
            h = h + self.per_layer_residual(h, per_layer_input)
        return h * self.layer_scalar


class Gemma4ForCausalLM(CausalLM):
    supports_kv_sharing = True
    unused_prefixes = MULTIMODAL_PARTS

    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config, act="gelu_pytorch_tanh", tied=True)
        raw = cfg.raw
        if raw.get("use_bidirectional_attention") == "all":
            raise NotImplementedError("Gemma 4 with use_bidirectional_attention='all' (an "
                                      "encoder) is not supported; causal models only")
        per_layer = int(raw.get("hidden_size_per_layer_input") or 0)
        model = PerLayerInputsModel(
            cfg.hidden_size, cfg.num_layers, per_layer,
            int(raw.get("vocab_size_per_layer_input") or cfg.vocab_size),
            cfg.rms_norm_eps) if per_layer else None
        layers = [Gemma4DecoderLayer(cfg, i, kind or FULL) for i, kind in enumerate(cfg.kinds)]
        for layer, target in cfg.kv_targets.items():
            layers[layer].self_attn.read_keys_of(layers[target].self_attn)
        super().__init__(cfg, layers, embed_scale=cfg.hidden_size ** 0.5, model=model)
        self.has_per_layer_inputs = model is not None

    def per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor
                         ) -> torch.Tensor | None:
        if not self.has_per_layer_inputs:
            return None
        return self.model.per_layer_inputs(input_ids, h)  # type: ignore[no-any-return,operator]
