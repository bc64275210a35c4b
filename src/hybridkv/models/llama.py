"""The Llama family of decoders: Llama, Qwen3, Mistral, Gemma 2, Gemma 3 text and gpt-oss.

They differ in a handful of switches read from the config: q/k norms (Qwen3, Gemma 3),
Gemma's `(1 + w)` norms, sandwich norms and embedding scale, soft-capping (Gemma 2), RoPE
parameters per layer type (Gemma 3), attention sinks and a top-k MoE (gpt-oss). Which layers
slide comes from `layer_mix`, the reader the KV planner uses, so the attention masks and the
KV cache groups cannot disagree. Any of them may read other layers' KV caches
(`kv_sharing_target_layers`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import FULL, SLIDING
from hybridkv.models.layers.activations import clamped_swiglu
from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.moe import MoE, Routing, StackedExperts
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.text_config import TextConfig
from hybridkv.worker.attention import AttentionParams

GEMMA_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text")
QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3", "gemma3_text")


def gpt_oss_moe(cfg: TextConfig) -> MoE:
    """Softmax over the top-k router logits; fused experts with biases whose gate and up
    columns interleave, through a clamped SwiGLU."""
    alpha = float(cfg.raw.get("swiglu_alpha", 1.702))
    limit = float(cfg.raw.get("swiglu_limit", 7.0))
    experts = StackedExperts(
        int(cfg.raw["num_local_experts"]), cfg.hidden_size, cfg.intermediate_size,
        lambda gate, up: clamped_swiglu(gate, up, alpha=alpha, limit=limit),
        transposed=True, interleaved=True, bias=True)
    routing = Routing(int(cfg.raw["num_experts_per_tok"]), "softmax_topk", float32=False)
    return MoE(cfg.hidden_size, experts, routing, router_bias=True)


def decoder_layer(cfg: TextConfig, layer: int, kind: str) -> DecoderLayer:
    gemma = cfg.model_type in GEMMA_TYPES
    scalar = cfg.raw.get("query_pre_attn_scalar")
    shape = AttentionShape.from_config(cfg, qk_norm=cfg.model_type in QK_NORM_TYPES,
                                       norm_offset=1.0 if gemma else 0.0,
                                       sinks=cfg.model_type == "gpt_oss")
    params = AttentionParams(
        scale=(float(scalar) ** -0.5) if gemma and scalar else cfg.head_dim ** -0.5,
        softcap=cfg.raw.get("attn_logit_softcapping"),
        sliding_window=cfg.sliding_window if kind == SLIDING else None)
    attn = Attention(layer, shape, params, rotary=Rotary.from_config(cfg.raw, cfg.head_dim, kind),
                     reads_shared_kv=layer in cfg.kv_targets)
    mlp = gpt_oss_moe(cfg) if cfg.model_type == "gpt_oss" else GatedMLP(
        cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
    # Gemma 2/3 normalise both sides of each sublayer ("sandwich").
    names = LayerNames("self_attn", ffn_norm="pre_feedforward_layernorm",
                       post_mixer_norm="post_attention_layernorm",
                       post_ffn_norm="post_feedforward_layernorm") \
        if gemma and cfg.model_type != "gemma" else LayerNames("self_attn")
    return DecoderLayer(names, attn, [mlp], cfg.hidden_size, cfg.rms_norm_eps,
                        norm_offset=shape.norm_offset)


class DecoderForCausalLM(CausalLM):
    supports_kv_sharing = True

    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config)
        kinds = [kind or FULL for kind in cfg.kinds]
        if any(k not in (FULL, SLIDING) for k in kinds):
            raise NotImplementedError(f"{cfg.model_type}: layer kinds {set(kinds)} are not "
                                      f"supported by the Llama-family decoder")
        gemma = cfg.model_type in GEMMA_TYPES
        super().__init__(cfg, (decoder_layer(cfg, i, k) for i, k in enumerate(kinds)),
                         norm_offset=1.0 if gemma else 0.0,
                         embed_scale=cfg.hidden_size ** 0.5 if gemma else None)
