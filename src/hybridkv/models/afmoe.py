"""AFMoE (Arcee Trinity): sliding-window layers with RoPE and full layers without position
encoding (NoPE), per-head q/k norms, a sigmoid output gate from its own projection, sandwich
norms around both sublayers, dense MLPs on the first `num_dense_layers` layers and routed +
shared experts on the rest: sigmoid scores, a bias that steers the choice only, the chosen
scores renormalised and scaled by `route_scale` (layers/grouped_topk.py with one group).
With `mup_enabled` the embedding is scaled by sqrt(hidden). Checkpoints name the router
`mlp.router.gate` and its bias `mlp.expert_bias`; they are renamed on load."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import SLIDING
from hybridkv.models.layers.attention import AttentionShape
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.grouped_topk import GroupedTopKRouter, SharedExpertsMoE
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.moe import ExpertMLPs
from hybridkv.models.layers.output_gated_attention import OutputGatedAttention
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.text_config import TextConfig
from hybridkv.models.weights import renamed
from hybridkv.worker.attention.backend import AttentionParams

CHECKPOINT_NAMES = ((r"\.mlp\.router\.gate\.", ".mlp.gate."),
                    (r"\.mlp\.expert_bias$", ".mlp.gate.e_score_correction_bias"))
NAMES = LayerNames("self_attn", post_mixer_norm="post_attention_layernorm",
                   ffn_norm="pre_mlp_layernorm", post_ffn_norm="post_mlp_layernorm")


def routed_moe(cfg: TextConfig) -> SharedExpertsMoE:
    raw, hidden = cfg.raw, cfg.hidden_size
    num_experts, size = int(raw["num_experts"]), int(raw["moe_intermediate_size"])
    gate = GroupedTopKRouter(hidden, num_experts, int(raw["num_experts_per_tok"]),
                             scale=float(raw.get("route_scale") or 1.0), float32_logits=False)
    shared = int(raw.get("num_shared_experts") or 0)
    return SharedExpertsMoE(hidden, gate, ExpertMLPs(num_experts, hidden, size, cfg.hidden_act),
                            GatedMLP(hidden, size * shared, cfg.hidden_act) if shared else None)


def afmoe_layer(cfg: TextConfig, layer: int, kind: str) -> DecoderLayer:
    sliding = kind == SLIDING
    attn = OutputGatedAttention(
        layer, AttentionShape.from_config(cfg, qk_norm=True),
        AttentionParams(scale=cfg.head_dim ** -0.5,
                        sliding_window=cfg.sliding_window if sliding else None),
        rotary=Rotary.from_config(cfg.raw, cfg.head_dim, kind) if sliding else None)
    mlp: nn.Module = routed_moe(cfg) if layer >= int(cfg.raw.get("num_dense_layers") or 0) \
        else GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
    return DecoderLayer(NAMES, attn, [mlp], cfg.hidden_size, cfg.rms_norm_eps)


class AfmoeForCausalLM(CausalLM):
    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config)
        kinds = cfg.attention_kinds()
        super().__init__(cfg, (afmoe_layer(cfg, i, k) for i, k in enumerate(kinds)),
                         embed_scale=cfg.hidden_size ** 0.5 if cfg.raw.get("mup_enabled")
                         else None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(renamed(weights, CHECKPOINT_NAMES))
