"""Jamba: Mamba1 layers with attention layers (no positional encoding) every
`attn_layer_period`, a top-k MoE every `expert_layer_period` layers and a SwiGLU MLP
elsewhere. The MoE takes a softmax over all experts, then the top-k weights as they are (no
renormalising)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import MAMBA1
from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.mamba1 import Mamba1Mixer
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.moe import ExpertMLPs, MoE, Routing
from hybridkv.models.text_config import TextConfig
from hybridkv.worker.attention.backend import AttentionParams


def jamba_layer(cfg: TextConfig, layer: int, kind: str | None) -> DecoderLayer:
    raw, hidden = cfg.raw, cfg.hidden_size
    mixer: nn.Module
    if kind == MAMBA1:
        name, mixer = "mamba", Mamba1Mixer(raw, layer)
    else:
        name, mixer = "self_attn", Attention(
            layer, AttentionShape.from_config(cfg), AttentionParams(scale=cfg.head_dim ** -0.5),
            rotary=None)
    period = int(raw.get("expert_layer_period", 2))
    offset = int(raw.get("expert_layer_offset", 1))
    num_experts = int(raw.get("num_experts", 1))
    ffn: nn.Module = GatedMLP(hidden, cfg.intermediate_size, cfg.hidden_act)
    if num_experts > 1 and layer % period == offset:
        ffn = MoE(hidden, ExpertMLPs(num_experts, hidden, cfg.intermediate_size, cfg.hidden_act),
                  Routing(int(raw.get("num_experts_per_tok", 2)), "softmax"))
    return DecoderLayer(LayerNames(name, ffn_norm="pre_ff_layernorm", ffns=("feed_forward",)),
                        mixer, [ffn], hidden, cfg.rms_norm_eps)


class JambaForCausalLM(CausalLM):
    norm_name = "final_layernorm"

    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config)
        super().__init__(cfg, (jamba_layer(cfg, i, k) for i, k in enumerate(cfg.kinds)))
