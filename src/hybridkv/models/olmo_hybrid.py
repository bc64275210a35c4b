"""OLMo Hybrid: Gated DeltaNet on three of every four layers (`layer_types`), OLMo 3's
attention on the fourth. The two kinds of layer are built differently:

    DeltaNet layer (pre-norm):   h = h + linear_attn(input_layernorm(h))
                                 h = h + mlp(post_attention_layernorm(h))
    attention layer (post-norm): h = h + post_attention_layernorm(self_attn(h))
                                 h = h + post_feedforward_layernorm(mlp(h))

Attention normalises q and k over the whole projection (all heads at once); RoPE only when
the config gives a `rope_theta` (released checkpoints set it to null: no position encoding,
the DeltaNet layers carry order). The DeltaNet scales beta by 2 when
`linear_allow_neg_eigval` (OlmoGatedDeltaNet).

Checkpoints name the norms by role (`attention_layer_norm` is the DeltaNet layers' input
norm, `feedforward_layer_norm` the norm after the mixer) and keep the conv weights of q, k
and v apart (`q_conv1d`, `k_conv1d`, `v_conv1d`, concatenated here in that order)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import FULL, LINEAR, with_family_defaults
from hybridkv.models.layers.attention import AttentionShape
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.flat_qk_norm import FlatQKNormAttention
from hybridkv.models.layers.gated_deltanet_olmo import OlmoGatedDeltaNet
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.rotary import Rotary, rope_params
from hybridkv.models.text_config import TextConfig
from hybridkv.models.weights import renamed
from hybridkv.worker.attention.backend import AttentionParams

POST_NORMS = LayerNames("self_attn", mixer_norm=None, ffn_norm=None,
                        post_mixer_norm="post_attention_layernorm",
                        post_ffn_norm="post_feedforward_layernorm")
PRE_NORMS = LayerNames("linear_attn")
NORM_NAMES = ((r"\.attention_layer_norm\.", ".input_layernorm."),
              (r"\.feedforward_layer_norm\.", ".post_attention_layernorm."))
CONV_PARTS = ("q_conv1d", "k_conv1d", "v_conv1d")


def olmo_hybrid_layer(cfg: TextConfig, layer: int, kind: str | None) -> DecoderLayer:
    mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
    if kind == LINEAR:
        return DecoderLayer(PRE_NORMS, OlmoGatedDeltaNet(cfg.raw, layer), [mlp],
                            cfg.hidden_size, cfg.rms_norm_eps)
    if kind != FULL:
        raise NotImplementedError(f"olmo_hybrid: layer {layer} is {kind!r}; layer_types "
                                  f"accepts linear_attention and full_attention")
    # transformers' OLMo Hybrid has no head_dim field: heads are hidden / num_heads wide.
    head_dim = cfg.hidden_size // cfg.num_heads
    rotary = None if rope_params(cfg.raw, FULL).get("rope_theta") is None else \
        Rotary.from_config(cfg.raw, head_dim, FULL)
    attn: nn.Module = FlatQKNormAttention(
        layer, AttentionShape.from_config(cfg, head_dim=head_dim),
        AttentionParams(scale=head_dim ** -0.5), rotary=rotary)
    return DecoderLayer(POST_NORMS, attn, [mlp], cfg.hidden_size, cfg.rms_norm_eps)


class OlmoHybridForCausalLM(CausalLM):
    def __init__(self, config: Mapping[str, Any]) -> None:
        text = config.get("text_config") or config
        cfg = TextConfig.from_hf(with_family_defaults(text))
        super().__init__(cfg, (olmo_hybrid_layer(cfg, i, k) for i, k in enumerate(cfg.kinds)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(fused_conv(renamed(weights, NORM_NAMES)))


def fused_conv(weights: Iterable[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """`linear_attn.{q,k,v}_conv1d.weight` -> one `linear_attn.conv1d.weight`, concatenated
    in q, k, v order once a layer's three parts have come."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        match = re.fullmatch(r"(.*\.linear_attn\.)([qkv]_conv1d)\.weight", name)
        if match is None:
            yield name, tensor
            continue
        prefix, part = match.groups()
        parts.setdefault(prefix, {})[part] = tensor
        if len(parts[prefix]) == len(CONV_PARTS):
            got = parts.pop(prefix)
            yield prefix + "conv1d.weight", torch.cat([got[p] for p in CONV_PARTS])
    if parts:
        prefix, got = next(iter(parts.items()))
        raise ValueError(f"checkpoint has {', '.join(sorted(got))} for {prefix[:-1]} but not "
                         f"all of {', '.join(CONV_PARTS)}")
