"""Cohere 2 (Command R7B, Command A) and Cohere 2 MoE: sliding-window layers with RoPE and
full-attention layers without any position encoding (NoPE), in parallel residual blocks
(attention and MLP side by side after one bias-free LayerNorm). Quirks matched from
transformers: the RoPE rotates adjacent pairs of each head (Cohere's interleaved layout), and
logits are multiplied by `logit_scale`; the embedding is tied by default.

Cohere 2 MoE: dense prefix layers then top-k experts (softmax over the top-k logits, or
their sigmoids, renormalised with `norm_topk_prob`) plus shared experts, summed or averaged
with them; RMSNorms where the config gives `rms_norm_eps`; the dense prefix layers keep RoPE
on full layers when `prefix_dense_sliding_window_pattern` is 1 (all of them full)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import SLIDING
from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.moe import ExpertMLPs, Routing, route
from hybridkv.models.layers.norms import RMSNorm
from hybridkv.models.layers.parallel_block import FloatLayerNorm, ParallelBlock
from hybridkv.models.layers.rotary import rope_params
from hybridkv.models.layers.rotary_pairs import AdjacentPairRotary
from hybridkv.models.text_config import TextConfig
from hybridkv.worker.attention.backend import AttentionParams


class Cohere2MoE(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        raw, hidden, size = cfg.raw, cfg.hidden_size, cfg.intermediate_size
        num_experts, shared = int(raw["num_experts"]), int(raw.get("num_shared_experts") or 0)
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = ExpertMLPs(num_experts, hidden, size, cfg.hidden_act)
        self.shared_experts = GatedMLP(hidden, size * shared, cfg.hidden_act) if shared \
            else None
        sigmoid = raw.get("expert_selection_fn", "softmax") == "sigmoid"
        self.routing = Routing(int(raw["num_experts_per_tok"]),
                               "sigmoid" if sigmoid else "softmax_topk",
                               renormalize=sigmoid and bool(raw.get("norm_topk_prob", True)))
        self.average = raw.get("shared_expert_combination_strategy", "average") == "average"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.routing, x.dtype)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
            out = out / 2 if self.average else out
        return out  # type: ignore[no-any-return]


def norm(cfg: TextConfig) -> nn.Module:
    if cfg.raw.get("rms_norm_eps") is not None:
        return RMSNorm(cfg.hidden_size, float(cfg.raw["rms_norm_eps"]))
    return FloatLayerNorm(cfg.hidden_size, float(cfg.raw.get("layer_norm_eps") or 1e-5))


def cohere2_layer(cfg: TextConfig, layer: int, kind: str) -> ParallelBlock:
    sliding = kind == SLIDING
    dense = (cfg.raw.get("mlp_layer_types") or ["dense"] * cfg.num_layers)[layer] == "dense"
    roped = sliding or (dense and cfg.model_type == "cohere2_moe" and
                        int(cfg.raw.get("prefix_dense_sliding_window_pattern", 1)) == 1)
    attn = Attention(layer, AttentionShape.from_config(cfg),
                     AttentionParams(scale=cfg.head_dim ** -0.5,
                                     sliding_window=cfg.sliding_window if sliding else None),
                     rotary=AdjacentPairRotary(cfg.head_dim, rope_params(cfg.raw, kind))
                     if roped else None)
    size = cfg.raw.get("prefix_dense_intermediate_size") or cfg.intermediate_size
    mlp = GatedMLP(cfg.hidden_size, int(size), cfg.hidden_act) if dense else Cohere2MoE(cfg)
    return ParallelBlock(attn, mlp, norm(cfg))


class Cohere2ForCausalLM(CausalLM):
    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config, tied=True)
        kinds = cfg.attention_kinds()
        super().__init__(cfg, (cohere2_layer(cfg, i, k) for i, k in enumerate(kinds)))
        self.model.norm = norm(cfg)
        self.logit_scale = float(cfg.raw.get("logit_scale", 1.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.logit_scale
