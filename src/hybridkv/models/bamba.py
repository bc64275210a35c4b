"""Bamba: Mamba2 layers with attention layers (RoPE on part of each head) at
`attn_layer_indices`, a SwiGLU MLP after every mixer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import FULL, MAMBA
from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.mamba2 import Mamba2Mixer
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.text_config import TextConfig
from hybridkv.worker.attention.backend import AttentionParams


def bamba_layer(cfg: TextConfig, layer: int, kind: str | None) -> DecoderLayer:
    mixer: nn.Module
    if kind == MAMBA:
        name, mixer = "mamba", Mamba2Mixer(cfg.raw, layer)
    elif kind == FULL:
        name, mixer = "self_attn", Attention(
            layer, AttentionShape.from_config(cfg), AttentionParams(scale=cfg.head_dim ** -0.5),
            rotary=Rotary.from_config(cfg.raw, cfg.head_dim, FULL))
    else:
        raise NotImplementedError(f"Bamba layer {layer}: {kind} layers are not supported")
    mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
    return DecoderLayer(LayerNames(name, ffn_norm="pre_ff_layernorm", ffns=("feed_forward",)),
                        mixer, [mlp], cfg.hidden_size, cfg.rms_norm_eps)


class BambaForCausalLM(CausalLM):
    norm_name = "final_layernorm"

    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config, eps=1e-5)
        super().__init__(cfg, (bamba_layer(cfg, i, k) for i, k in enumerate(cfg.kinds)))
