"""ModernBERT-Decoder: ModernBERT's encoder blocks run causally, with sliding-window layers
between full ones (`layer_types`; the window is half of `local_attention`), RoPE θ per layer
type, LayerNorms (bias per `norm_bias`) everywhere:

    embed -> LayerNorm (`embeddings.norm`)
    layers: h + attn(attn_norm(h)) (layer 0 has no attn_norm), h + mlp(mlp_norm(h));
            attention with as many KV heads as query heads, heads of hidden / heads,
            o_proj named `Wo`; MLP `Wo(act(x) * gate)`, [x | gate] = `Wi`(h)
    final_norm -> prediction head LayerNorm(act(dense(h))) -> `decoder` (with a bias,
            tied to the embedding unless the config says otherwise)

Checkpoint names are mapped onto the kit's on load (`decoder` -> `lm_head`, the prediction
head -> `head`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import SLIDING
from hybridkv.models.layers.activations import activation
from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.text_config import TextConfig
from hybridkv.models.weights import renamed
from hybridkv.worker.attention.backend import AttentionParams

# In order: the prediction head leaves `lm_head` before the decoder takes the name.
CHECKPOINT_NAMES = ((r"^lm_head\.", "head."), (r"^decoder\.", "lm_head."),
                    (r"^model\.embeddings\.tok_embeddings\.", "model.embed_tokens."),
                    (r"^model\.embeddings\.norm\.", "model.embed_norm."),
                    (r"\.attn\.Wo\.", ".attn.o_proj."))


class PredictionHead(nn.Module):
    """h [N, hidden] -> norm(act(dense(h)))."""

    def __init__(self, hidden: int, act: str, norm: nn.Module, bias: bool) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden, bias=bias)
        self.act, self.norm = activation(act), norm

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(h)))  # type: ignore[no-any-return]


def decoder_layer(cfg: TextConfig, layer: int, kind: str, eps: float, norm_bias: bool
                  ) -> DecoderLayer:
    heads = cfg.num_heads
    head_dim = cfg.hidden_size // heads
    shape = AttentionShape.from_config(cfg, num_kv_heads=heads, head_dim=head_dim)
    # Configs may give only the encoder's `local_attention`, twice the window.
    window = cfg.sliding_window or int(cfg.raw.get("local_attention") or 0) // 2
    attn = Attention(layer, shape, AttentionParams(
        scale=head_dim ** -0.5, sliding_window=window if kind == SLIDING else None),
        rotary=Rotary.from_config(cfg.raw, head_dim, kind))
    mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act,
                   bias=bool(cfg.raw.get("mlp_bias", False)), fused=("Wi", "Wo"))
    names = LayerNames("attn", mixer_norm="attn_norm" if layer else None, ffn_norm="mlp_norm")
    return DecoderLayer(names, attn, [mlp], cfg.hidden_size, eps,
                        norm=lambda dim, eps: nn.LayerNorm(dim, eps=eps, bias=norm_bias))


class ModernBertDecoderForCausalLM(CausalLM):
    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config, act="gelu", tied=True)
        raw = cfg.raw
        eps, norm_bias = float(raw.get("norm_eps") or 1e-5), bool(raw.get("norm_bias", False))
        kinds = cfg.attention_kinds()
        super().__init__(cfg, (decoder_layer(cfg, i, k, eps, norm_bias)
                               for i, k in enumerate(kinds)))
        self.model.embed_norm = nn.LayerNorm(cfg.hidden_size, eps=eps, bias=norm_bias)
        self.model.norm = nn.LayerNorm(cfg.hidden_size, eps=eps, bias=norm_bias)
        self.head = PredictionHead(cfg.hidden_size, str(raw.get("classifier_activation")
                                                        or "gelu"),
                                   nn.LayerNorm(cfg.hidden_size, eps=eps, bias=norm_bias),
                                   bool(raw.get("classifier_bias", False)))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size,
                                 bias=bool(raw.get("decoder_bias", True)))
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        norm = cast(nn.LayerNorm, self.model.embed_norm)
        return norm(super().embed(input_ids))  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(self.head(hidden))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        weights = ((name.replace("model.final_norm.", "model.norm."), t) for name, t in weights)
        super().load_weights(renamed(weights, CHECKPOINT_NAMES))
