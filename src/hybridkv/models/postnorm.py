"""EXAONE 4 and OLMo 3: decoders that normalise each sublayer's output instead of its input
(`h + norm(attn(h))`, `h + norm(mlp(h))`, no pre-norms), with sliding-window and full layers
(`layer_types`) and q/k RMSNorms.

- EXAONE 4: per-head q/k norms; when the model has sliding layers, its full layers use no
  position encoding (RoPE only on the sliding ones), as in transformers.
- OLMo 3: q/k norms over the whole projection (all heads at once); RoPE everywhere, with its
  parameters per layer type."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import SLIDING
from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.flat_qk_norm import FlatQKNormAttention
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.text_config import TextConfig
from hybridkv.worker.attention.backend import AttentionParams

POST_NORMS = LayerNames("self_attn", mixer_norm=None, ffn_norm=None,
                        post_mixer_norm="post_attention_layernorm",
                        post_ffn_norm="post_feedforward_layernorm")


def postnorm_layer(cfg: TextConfig, layer: int, kind: str, has_sliding: bool) -> DecoderLayer:
    exaone = cfg.model_type == "exaone4"
    params = AttentionParams(scale=cfg.head_dim ** -0.5,
                             sliding_window=cfg.sliding_window if kind == SLIDING else None)
    rotary = None if exaone and has_sliding and kind != SLIDING else \
        Rotary.from_config(cfg.raw, cfg.head_dim, kind)
    attn = Attention(layer, AttentionShape.from_config(cfg, qk_norm=True), params,
                     rotary=rotary) if exaone else FlatQKNormAttention(
        layer, AttentionShape.from_config(cfg), params, rotary=rotary)
    mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
    return DecoderLayer(POST_NORMS, attn, [mlp], cfg.hidden_size, cfg.rms_norm_eps)


class PostNormForCausalLM(CausalLM):
    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config)
        kinds = cfg.attention_kinds()
        has_sliding = SLIDING in kinds
        super().__init__(cfg, (postnorm_layer(cfg, i, k, has_sliding)
                               for i, k in enumerate(kinds)))
