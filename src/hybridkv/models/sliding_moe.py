"""Flint, Kolibri 1, Laguna and Mellum: MoE decoders with sliding-window and full layers
(`layer_types`), per-head q/k norms, and routed experts stored one MLP per expert.

- Flint: full layers without position encoding (NoPE); a learned sink logit per head
  (checkpoints: `self_attn.softmax_offset`); dense MLPs on `mlp_only_layers` and off every
  `decoder_sparse_step`-th layer; sigmoid scores, top k, renormalised (`norm_topk_prob`),
  plus an ungated `shared_expert`.
- Kolibri 1: NoPE full layers (when the model has a window); sandwich norms around both
  sublayers (checkpoints: `post_attn_norm`, `post_ffn_norm`); every layer routed: the
  expert bias is added to the raw logits to choose, the weights are the chosen logits'
  sigmoids (layers/biased_sigmoid_moe.py), plus `shared_experts`.
- Laguna: RoPE per layer type, on part of each head (`partial_rotary_factor` in
  `rope_parameters`); query heads per layer (`num_attention_heads_per_layer`); a softplus
  output gate per head or per channel (`gating`); dense/sparse per `mlp_layer_types`; sigmoid
  scores with a choosing bias, optionally soft-capped logits, `moe_routed_scaling_factor`,
  plus a `shared_expert`.
- Mellum: RoPE per layer type; dense/sparse per `mlp_layer_types`; softmax routing."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import SLIDING
from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.biased_sigmoid_moe import BiasedSigmoidMoE
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.moe import ExpertMLPs, MoE, Routing
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.layers.softplus_gated_attention import SoftplusGatedAttention
from hybridkv.models.text_config import TextConfig
from hybridkv.models.weights import renamed
from hybridkv.worker.attention.backend import AttentionParams

CHECKPOINT_NAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "flint": ((r"\.self_attn\.softmax_offset$", ".self_attn.sinks"),),
    "kolibri1": ((r"\.moe\.router\.expert_bias$", ".mlp.e_score_correction_bias"),),
    "laguna": ((r"\.mlp\.experts\.e_score_correction_bias$", ".mlp.e_score_correction_bias"),),
}
KOLIBRI_NAMES = LayerNames("self_attn", post_mixer_norm="post_attn_norm",
                           ffn_norm="post_attention_layernorm", post_ffn_norm="post_ffn_norm")


def is_sparse(cfg: TextConfig, layer: int) -> bool:
    raw = cfg.raw
    if cfg.model_type == "kolibri1":
        return True
    if cfg.model_type == "flint":
        return layer not in (raw.get("mlp_only_layers") or []) and \
            (layer + 1) % int(raw.get("decoder_sparse_step") or 1) == 0
    return bool((raw.get("mlp_layer_types") or ["sparse"] * cfg.num_layers)[layer] == "sparse")


def routed(cfg: TextConfig) -> nn.Module:
    raw, hidden, act = cfg.raw, cfg.hidden_size, cfg.hidden_act
    # Kolibri 1 and Mellum save `num_experts` as `num_local_experts`.
    num_experts = int(raw.get("num_experts") or raw["num_local_experts"])
    top_k = int(raw["num_experts_per_tok"])
    experts = ExpertMLPs(num_experts, hidden, int(raw["moe_intermediate_size"]), act)
    shared_size = int(raw.get("shared_expert_intermediate_size") or 0)
    shared = GatedMLP(hidden, shared_size, act) if shared_size else None
    renormalize = bool(raw.get("norm_topk_prob", False))
    if cfg.model_type == "mellum":
        return MoE(hidden, experts, Routing(top_k, "softmax", renormalize=renormalize),
                   router_name="gate")
    if cfg.model_type == "flint":
        return MoE(hidden, experts, Routing(top_k, "sigmoid", renormalize=renormalize),
                   router_name="gate", shared_expert=shared)
    if cfg.model_type == "kolibri1":
        return BiasedSigmoidMoE(hidden, experts, top_k, select_on="logits",
                                renormalize=renormalize, shared=shared,
                                shared_name="shared_experts")
    return BiasedSigmoidMoE(  # Laguna
        hidden, experts, top_k, select_on="scores", renormalize=True, shared=shared,
        shared_name="shared_expert",
        routed_scaling=float(raw.get("moe_routed_scaling_factor") or 1.0),
        softcap=float(raw.get("moe_router_logit_softcapping") or 0.0), float32_logits=False)


def attention(cfg: TextConfig, layer: int, kind: str) -> Attention:
    raw = cfg.raw
    sliding = kind == SLIDING
    # Flint's full layers are NoPE; Kolibri 1's whenever the config has a window.
    nope = not sliding and (cfg.model_type == "flint" or (
        cfg.model_type == "kolibri1" and cfg.sliding_window is not None))
    rotary = None if nope else Rotary.from_config(raw, cfg.head_dim, kind)
    params = AttentionParams(scale=cfg.head_dim ** -0.5,
                             sliding_window=cfg.sliding_window if sliding else None)
    if cfg.model_type == "laguna":
        heads = (raw.get("num_attention_heads_per_layer") or [cfg.num_heads] * cfg.num_layers)
        shape = AttentionShape.from_config(cfg, qk_norm=True, num_heads=int(heads[layer]))
        gating = raw.get("gating", True)
        if gating not in (True, "per-head", "per-element"):
            raise ValueError(f"laguna: gating={gating!r}; accepted: true, 'per-head', "
                             f"'per-element'")
        return SoftplusGatedAttention(layer, shape, params, rotary=rotary,
                                      per_head=gating in (True, "per-head"))
    shape = AttentionShape.from_config(cfg, qk_norm=True, sinks=cfg.model_type == "flint")
    return Attention(layer, shape, params, rotary=rotary)


def sliding_moe_layer(cfg: TextConfig, layer: int, kind: str) -> DecoderLayer:
    mlp = routed(cfg) if is_sparse(cfg, layer) else GatedMLP(
        cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
    names = KOLIBRI_NAMES if cfg.model_type == "kolibri1" else LayerNames("self_attn")
    return DecoderLayer(names, attention(cfg, layer, kind), [mlp],
                        cfg.hidden_size, cfg.rms_norm_eps)


class SlidingMoEForCausalLM(CausalLM):
    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config)
        super().__init__(cfg, (sliding_moe_layer(cfg, i, k)
                               for i, k in enumerate(cfg.attention_kinds())))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(renamed(weights, CHECKPOINT_NAMES.get(self.cfg.model_type, ())))
