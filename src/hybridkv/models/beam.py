"""Beam: sliding-window layers with RoPE and full layers without position encoding whose
queries grow with position (`rope_parameters[type]` None: layers/scalable_softmax_attention.py),
per-head q/k norms, a biased sigmoid output gate, sandwich norms and depth-scaled residual
adds (layers/depth_scaled_layer.py); dense MLPs per `mlp_layer_types`, else DeepSeek-V3-style
grouped sigmoid routing with a correction bias (layers/grouped_topk.py), no shared expert,
the routed sum times `routed_scaling_factor`; logits soft-capped (`final_logit_softcapping`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import SLIDING
from hybridkv.models.layers.attention import AttentionShape
from hybridkv.models.layers.decoder_layer import LayerNames
from hybridkv.models.layers.depth_scaled_layer import DepthScaledDecoderLayer
from hybridkv.models.layers.grouped_topk import GroupedTopKRouter, SharedExpertsMoE
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.moe import ExpertMLPs
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.layers.scalable_softmax_attention import ScalableSoftmaxAttention
from hybridkv.models.text_config import TextConfig
from hybridkv.worker.attention.backend import AttentionParams

NAMES = LayerNames("self_attn", post_mixer_norm="post_attention_layernorm",
                   ffn_norm="pre_feedforward_layernorm",
                   post_ffn_norm="post_feedforward_layernorm")


def routed_moe(cfg: TextConfig) -> SharedExpertsMoE:
    raw, hidden = cfg.raw, cfg.hidden_size
    num_experts = int(raw["num_experts"])
    gate = GroupedTopKRouter(
        hidden, num_experts, int(raw["num_experts_per_tok"]),
        num_groups=int(raw.get("n_group") or 1), topk_groups=int(raw.get("topk_group") or 1),
        renormalize=bool(raw.get("norm_topk_prob", True)),
        scale=float(raw.get("routed_scaling_factor") or 1.0))
    experts = ExpertMLPs(num_experts, hidden, int(raw["moe_intermediate_size"]), cfg.hidden_act)
    return SharedExpertsMoE(hidden, gate, experts, None)


def beam_layer(cfg: TextConfig, layer: int, kind: str) -> DepthScaledDecoderLayer:
    rope = cfg.raw.get("rope_parameters")
    layer_type = "sliding_attention" if kind == SLIDING else "full_attention"
    nope = isinstance(rope, Mapping) and layer_type in rope and rope[layer_type] is None
    attn = ScalableSoftmaxAttention(
        layer, AttentionShape.from_config(cfg, qk_norm=True),
        AttentionParams(scale=cfg.head_dim ** -0.5,
                        sliding_window=cfg.sliding_window if kind == SLIDING else None),
        rotary=None if nope else Rotary.from_config(cfg.raw, cfg.head_dim, kind))
    types = cfg.raw.get("mlp_layer_types") or ["sparse"] * cfg.num_layers
    mlp: nn.Module = routed_moe(cfg) if types[layer] == "sparse" else GatedMLP(
        cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
    return DepthScaledDecoderLayer(NAMES, attn, [mlp], cfg.hidden_size, cfg.rms_norm_eps,
                                   layer=layer)


class BeamForCausalLM(CausalLM):
    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config)
        super().__init__(cfg, (beam_layer(cfg, i, k)
                               for i, k in enumerate(cfg.attention_kinds())))
