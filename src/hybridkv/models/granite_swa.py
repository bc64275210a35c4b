"""Granite SWA and Granite MoE SWA: Granite decoders with sliding-window and full layers
(`layer_types`), a learned per-head attention sink in every layer, and a RoPE base per layer
(`layer_rope_theta`; 0 means the layer has no position encoding), with Granite's µP
multipliers (embedding, attention scale = `attention_multiplier`, residual, logits).
The MoE variant runs stacked experts (top-k logits, softmax over them) plus an optional
shared MLP, both on the same normed input, summed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import SLIDING
from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.moe import MoE, Routing, StackedExperts, act_glu
from hybridkv.models.layers.rotary import Rotary, rope_params
from hybridkv.models.text_config import TextConfig
from hybridkv.worker.attention.backend import AttentionParams


def layer_rotary(cfg: TextConfig, layer: int, kind: str) -> Rotary | None:
    thetas = cfg.raw.get("layer_rope_theta")
    if not thetas:
        return Rotary.from_config(cfg.raw, cfg.head_dim, kind)
    if not thetas[layer]:
        return None
    return Rotary(cfg.head_dim, {**rope_params(cfg.raw, kind), "rope_theta": thetas[layer]})


def ffns(cfg: TextConfig) -> tuple[tuple[str, ...], list[nn.Module]]:
    raw, hidden = cfg.raw, cfg.hidden_size
    if cfg.model_type == "granite_swa":
        return ("mlp",), [GatedMLP(hidden, cfg.intermediate_size, cfg.hidden_act,
                                   bias=bool(raw.get("mlp_bias", False)))]
    experts = StackedExperts(int(raw["num_local_experts"]), hidden, cfg.intermediate_size,
                             act_glu(cfg.hidden_act))
    moe = MoE(hidden, experts, Routing(int(raw["num_experts_per_tok"]), "softmax_topk"))
    shared = int(raw.get("shared_intermediate_size") or 0)
    if not shared:
        return ("block_sparse_moe",), [moe]
    return ("block_sparse_moe", "shared_mlp"), [moe, GatedMLP(
        hidden, shared, cfg.hidden_act, fused=("input_linear", "output_linear"))]


def granite_swa_layer(cfg: TextConfig, layer: int, kind: str) -> DecoderLayer:
    raw = cfg.raw
    params = AttentionParams(scale=float(raw.get("attention_multiplier") or 1.0),
                             sliding_window=cfg.sliding_window if kind == SLIDING else None)
    attn = Attention(layer, AttentionShape.from_config(cfg, sinks=True), params,
                     rotary=layer_rotary(cfg, layer, kind))
    names, modules = ffns(cfg)
    return DecoderLayer(LayerNames("self_attn", ffns=names), attn, modules, cfg.hidden_size,
                        cfg.rms_norm_eps,
                        residual_multiplier=float(raw.get("residual_multiplier") or 1.0))


class GraniteSWAForCausalLM(CausalLM):
    def __init__(self, config: Mapping[str, Any]) -> None:
        # Granite SWA ties by default, the MoE variant does not (their config classes).
        cfg = TextConfig.from_hf(config, tied=config.get("model_type") == "granite_swa")
        kinds = cfg.attention_kinds()
        super().__init__(cfg, (granite_swa_layer(cfg, i, k) for i, k in enumerate(kinds)))
