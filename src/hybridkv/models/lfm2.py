"""LFM2 (Liquid): gated short convolutions (a small conv state per request) on most layers,
attention with q/k norms and RoPE on the others, a SwiGLU MLP after each (LFM2-MoE: a
sigmoid-routed MoE from layer `num_dense_layers` on). The final norm is called
`embedding_norm`; checkpoint names differ from the kit's (`out_proj`, `q_layernorm`,
`feed_forward.w1/w3/w2`) and are renamed on load.

LFM3 adds sliding-window attention layers (RoPE per layer type: proportional RoPE on half
of the full layers' angles), a sigmoid gate per head (`g_proj`), sandwich norms
(`post_operator_norm`, `post_ffn_norm`) and Qwen3's attention names (`o_proj`, `q_norm`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import CONV, FULL, SLIDING
from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.head_gated_attention import HeadGatedAttention
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.moe import ExpertMLPs
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.layers.short_conv import ShortConv
from hybridkv.models.layers.sigmoid_moe import SigmoidBiasMoE
from hybridkv.models.text_config import TextConfig
from hybridkv.worker.attention.backend import AttentionParams

# checkpoint name part -> the kit's
RENAMES = ((".self_attn.out_proj.", ".self_attn.o_proj."),
           (".self_attn.q_layernorm.", ".self_attn.q_norm."),
           (".self_attn.k_layernorm.", ".self_attn.k_norm."),
           (".self_attn.gate_proj.", ".self_attn.g_proj."),  # LFM3's per-head gate
           (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


def mlp_size(raw: Mapping[str, Any]) -> int:
    """LFM2's dense MLP width: with `block_auto_adjust_ff_dim`, 2/3 of the configured size
    times `block_ffn_dim_multiplier`, rounded up to `block_multiple_of` (as the reference);
    LFM2-MoE's dense layers take the size as it is."""
    size = int(raw.get("intermediate_size") or raw["block_ff_dim"])
    if raw.get("model_type") == "lfm2" and raw.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        multiplier = raw.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple = int(raw.get("block_multiple_of", 256))
            size = multiple * -(-int(float(multiplier) * size) // multiple)
    return size


def lfm2_layer(cfg: TextConfig, layer: int, kind: str | None) -> DecoderLayer:
    raw, hidden = cfg.raw, cfg.hidden_size
    mixer: nn.Module
    if kind == CONV:
        name, mixer = "conv", ShortConv(hidden, int(raw["conv_L_cache"]), layer,
                                        bias=bool(raw.get("conv_bias", False)))
    elif kind in (FULL, SLIDING):
        gated = bool(raw.get("use_attention_gate", False))
        name, mixer = "self_attn", (HeadGatedAttention if gated else Attention)(
            layer, AttentionShape.from_config(cfg, qk_norm=True),
            AttentionParams(scale=cfg.head_dim ** -0.5,
                            sliding_window=cfg.sliding_window if kind == SLIDING else None),
            rotary=Rotary.from_config(raw, cfg.head_dim, kind))
    else:
        raise NotImplementedError(f"{cfg.model_type} layer {layer}: {kind} layers are not "
                                  f"supported")
    sandwich = bool(raw.get("use_sandwich_norm", False))
    names = LayerNames(name, mixer_norm="operator_norm", ffn_norm="ffn_norm",
                       ffns=("feed_forward",),
                       post_mixer_norm="post_operator_norm" if sandwich else None,
                       post_ffn_norm="post_ffn_norm" if sandwich else None)
    return DecoderLayer(names, mixer, [feed_forward(raw, hidden, layer)], hidden,
                        cfg.rms_norm_eps)


def feed_forward(raw: Mapping[str, Any], hidden: int, layer: int) -> nn.Module:
    """A SwiGLU MLP; for LFM2-MoE from layer `num_dense_layers` on, a sigmoid-routed MoE."""
    if raw.get("model_type") != "lfm2_moe" or layer < int(raw.get("num_dense_layers", 2)):
        return GatedMLP(hidden, mlp_size(raw), "silu")
    experts = ExpertMLPs(int(raw["num_experts"]), hidden, int(raw["moe_intermediate_size"]),
                         "silu")
    return SigmoidBiasMoE(hidden, experts, int(raw["num_experts_per_tok"]), router_name="gate",
                          expert_bias=bool(raw.get("use_expert_bias", True)),
                          renormalize=bool(raw.get("norm_topk_prob", True)),
                          scaling=float(raw.get("routed_scaling_factor", 1.0)))


class Lfm2ForCausalLM(CausalLM):
    norm_name = "embedding_norm"

    def __init__(self, config: Mapping[str, Any]) -> None:
        raw = config.get("text_config") or config
        cfg = TextConfig.from_hf(config, eps=float(raw.get("norm_eps", 1e-5)),
                                 tied=bool(raw.get("tie_embedding", True)))
        super().__init__(cfg, (lfm2_layer(cfg, i, k) for i, k in enumerate(cfg.kinds)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((_rename(name), tensor) for name, tensor in weights)


def _rename(name: str) -> str:
    for old, new in RENAMES:
        name = name.replace(old, new)
    return name
