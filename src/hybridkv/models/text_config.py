"""The text-config fields every family reads, read once from a Hugging Face config dict.

Field spellings vary across families (`hidden_activation` / `hidden_act`, `rms_norm_eps` /
`layer_norm_epsilon`, a `text_config` inside multimodal configs); they are resolved here so
families read `cfg.num_kv_heads`, not dict keys. Fields only one family uses stay in `raw`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridkv.models.layer_mix import FULL, SLIDING, kv_sharing_targets, layer_kinds


@dataclass(frozen=True, kw_only=True)
class TextConfig:
    raw: Mapping[str, Any]  # the text config, for fields of one family
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_sizes: tuple[int, ...]  # per layer (Gemma 3n gives a list)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    attention_bias: bool
    sliding_window: int | None
    tie_word_embeddings: bool
    layer_kinds: tuple[tuple[str, ...], ...]  # per layer, its KV-holding parts (layer_mix)
    kv_targets: Mapping[int, int]  # layer -> the layer whose KV cache it reads
    embedding_multiplier: float  # µP (Falcon-H1, Granite)
    logits_multiplier: float  # µP: lm_head_multiplier / logits_scaling
    final_logit_softcap: float | None

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def intermediate_size(self) -> int:
        return self.intermediate_sizes[0]

    @property
    def kinds(self) -> tuple[str | None, ...]:
        """Per layer, its first KV-holding part (None for an MLP-only layer)."""
        return tuple(parts[0] if parts else None for parts in self.layer_kinds)

    def attention_kinds(self) -> list[str]:
        """Per layer FULL or SLIDING, for the attention-only decoders; other kinds raise."""
        kinds = [kind or FULL for kind in self.kinds]
        if any(k not in (FULL, SLIDING) for k in kinds):
            raise NotImplementedError(f"{self.model_type}: layer kinds {set(kinds)} are not "
                                      f"supported by this attention-only decoder")
        return kinds

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], *, eps: float = 1e-6, act: str = "silu",
                tied: bool = False) -> TextConfig:
        """`eps`, `act`, `tied`: the family's defaults for fields a config may leave out."""
        cfg = config.get("text_config") or config
        # Attention-free models (Mamba) have no heads: one nominal head, never used.
        heads, hidden = int(cfg.get("num_attention_heads") or 1), int(cfg["hidden_size"])
        kinds = layer_kinds(config)
        inter = cfg.get("intermediate_size") or 0
        sizes = [int(s) for s in inter] if isinstance(inter, list) else [int(inter)] * len(kinds)
        return cls(
            raw=cfg, model_type=str(cfg.get("model_type") or config.get("model_type")),
            vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
            intermediate_sizes=tuple(sizes), num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(_first(cfg, "rms_norm_eps", "layer_norm_epsilon", default=eps)),
            hidden_act=str(_first(cfg, "hidden_activation", "hidden_act", default=act)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            sliding_window=cfg.get("sliding_window"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings",
                                                cfg.get("tie_word_embeddings", tied))),
            layer_kinds=tuple(kinds), kv_targets=kv_sharing_targets(config, kinds),
            embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
            logits_multiplier=float(cfg.get("lm_head_multiplier", 1.0)) / float(
                cfg.get("logits_scaling", 1.0)),
            final_logit_softcap=cfg.get("final_logit_softcapping"))


def _first(cfg: Mapping[str, Any], *names: str, default: Any) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default
