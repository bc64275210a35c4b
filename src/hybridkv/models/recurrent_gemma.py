"""RecurrentGemma (Griffin): recurrent blocks (a short conv and the RG-LRU, layers/rg_lru.py)
and local sliding-window attention in a repeating `block_types` pattern (two recurrent, one
attention), each followed by a GeGLU MLP with biases. Gemma's quirks: `(1 + w)` norms
(applied before the cast, as the reference does), an embedding scale of sqrt(hidden)
rounded to bfloat16 (the reference keeps it in a bfloat16 buffer), and soft-capped logits
(`logits_soft_cap`). Attention is multi-query, RoPE on half of each head, o_proj has a bias
while q/k/v do not."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import RG_LRU, SLIDING
from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.rg_lru import RecurrentBlock
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.text_config import TextConfig
from hybridkv.worker.attention.backend import AttentionParams

NAMES = LayerNames("temporal_block", mixer_norm="temporal_pre_norm",
                   ffn_norm="channel_pre_norm", ffns=("mlp_block",))


def griffin_layer(cfg: TextConfig, layer: int, kind: str | None) -> DecoderLayer:
    raw, hidden = cfg.raw, cfg.hidden_size
    mixer: nn.Module
    if kind == RG_LRU:
        mixer = RecurrentBlock(hidden, int(raw["lru_width"] or hidden),
                               int(raw.get("conv1d_width", 4)), cfg.num_heads, cfg.hidden_act,
                               layer)
    elif kind == SLIDING:
        mixer = Attention(layer, AttentionShape.from_config(cfg),
                          AttentionParams(scale=cfg.head_dim ** -0.5,
                                          sliding_window=int(raw["attention_window_size"])),
                          rotary=Rotary.from_config(raw, cfg.head_dim, SLIDING))
        mixer.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, hidden, bias=True)
    else:
        raise NotImplementedError(f"recurrent_gemma layer {layer}: {kind} blocks are not "
                                  f"supported")
    mlp = GatedMLP(hidden, cfg.intermediate_size // 2, cfg.hidden_act, bias=True)
    return DecoderLayer(NAMES, mixer, [mlp], hidden, cfg.rms_norm_eps, norm_offset=1.0)


class RecurrentGemmaForCausalLM(CausalLM):
    norm_name = "final_norm"

    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config, act="gelu_pytorch_tanh", tied=True)
        cfg = replace(cfg, final_logit_softcap=cfg.raw.get("logits_soft_cap"))
        scale = float(torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.bfloat16))
        super().__init__(cfg, (griffin_layer(cfg, i, k) for i, k in enumerate(cfg.kinds)),
                         norm_offset=1.0, embed_scale=scale)
