"""dots.llm1, EXAONE MoE and MiMo-V2-Flash: pre-norm decoders with sliding-window and full
layers (`layer_types`), dense MLPs on the first layers and DeepSeek-V3-style routed (+ shared)
experts on the rest (layers/grouped_topk.py).

- dots.llm1: RoPE on every layer; dense below `first_k_dense_replace`; `n_shared_experts`.
- EXAONE MoE: as EXAONE 4, full layers use no RoPE when the model has sliding layers;
  dense/sparse per `mlp_layer_types`; its checkpoints keep the router's correction bias as
  `mlp.e_score_correction_bias` (renamed on load).
- MiMo-V2-Flash: no q/k norms; sliding layers have twice the KV heads of full layers (so
  their KV cache groups differ in more than the window) and a learned sink per head
  (`attention_sink_bias`); values are narrower than keys (`v_head_dim`) and scaled by
  `attention_value_scale` (layers/padded_value_attention.py); RoPE on part of each head."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import SLIDING
from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.grouped_topk import GroupedTopKRouter, SharedExpertsMoE
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.moe import ExpertMLPs
from hybridkv.models.layers.padded_value_attention import PaddedValueAttention
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.text_config import TextConfig
from hybridkv.models.weights import renamed
from hybridkv.worker.attention.backend import AttentionParams

EXAONE_MOE_NAMES = ((r"\.mlp\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),)
MIMO_NAMES = ((r"\.self_attn\.attention_sink_bias$", ".self_attn.sinks"),)


def is_sparse(cfg: TextConfig, layer: int) -> bool:
    types = cfg.raw.get("mlp_layer_types")
    if types:
        return bool(types[layer] == "sparse")
    return layer >= int(cfg.raw.get("first_k_dense_replace") or 0)


def routed_moe(cfg: TextConfig) -> SharedExpertsMoE:
    raw, hidden = cfg.raw, cfg.hidden_size
    num_experts = int(raw.get("n_routed_experts") or raw.get("num_experts")
                      or raw["num_local_experts"])
    size = int(raw["moe_intermediate_size"])
    gate = GroupedTopKRouter(
        hidden, num_experts, int(raw["num_experts_per_tok"]),
        num_groups=int(raw.get("n_group") or 1), topk_groups=int(raw.get("topk_group") or 1),
        renormalize=bool(raw.get("norm_topk_prob", True)),
        scale=float(raw.get("routed_scaling_factor") or 1.0))
    shared = int(raw.get("n_shared_experts") or raw.get("num_shared_experts") or 0)
    return SharedExpertsMoE(hidden, gate, ExpertMLPs(num_experts, hidden, size, cfg.hidden_act),
                            GatedMLP(hidden, size * shared, cfg.hidden_act) if shared else None)


def grouped_moe_layer(cfg: TextConfig, layer: int, kind: str, has_sliding: bool
                      ) -> DecoderLayer:
    nope = cfg.model_type == "exaone_moe" and has_sliding and kind != SLIDING
    params = AttentionParams(scale=cfg.head_dim ** -0.5,
                             sliding_window=cfg.sliding_window if kind == SLIDING else None)
    rotary = None if nope else Rotary.from_config(cfg.raw, cfg.head_dim, kind)
    attn: Attention
    if cfg.model_type == "mimo_v2_flash":
        shape = AttentionShape.from_config(cfg, sinks=kind == SLIDING, num_kv_heads=(
            2 if kind == SLIDING else 1) * cfg.num_kv_heads)
        attn = PaddedValueAttention(
            layer, shape, params, rotary=rotary, value_head_dim=int(cfg.raw["v_head_dim"]),
            value_scale=float(cfg.raw.get("attention_value_scale") or 1.0))
    else:
        attn = Attention(layer, AttentionShape.from_config(cfg, qk_norm=True), params,
                         rotary=rotary)
    mlp: nn.Module = routed_moe(cfg) if is_sparse(cfg, layer) else GatedMLP(
        cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
    return DecoderLayer(LayerNames("self_attn"), attn, [mlp], cfg.hidden_size, cfg.rms_norm_eps)


class GroupedMoEForCausalLM(CausalLM):
    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config)
        kinds = cfg.attention_kinds()
        has_sliding = SLIDING in kinds
        super().__init__(cfg, (grouped_moe_layer(cfg, i, k, has_sliding)
                               for i, k in enumerate(kinds)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.cfg.model_type == "exaone_moe":
            weights = renamed(weights, EXAONE_MOE_NAMES)
        if self.cfg.model_type == "mimo_v2_flash":
            weights = renamed(weights, MIMO_NAMES)
        super().load_weights(weights)
