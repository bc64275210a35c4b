"""The Llama family of decoders: Llama, Mistral, Ministral, Ministral 3, Mixtral, Qwen2,
Qwen2-MoE, Qwen3, Qwen3-MoE, Phi-3, SmolLM3, Gemma 2, Gemma 3 text, VaultGemma and gpt-oss.

They differ in a handful of switches read from the config: q/k norms (Qwen3, Gemma 3),
q/k/v biases without an o_proj bias (Qwen2), Gemma's `(1 + w)` norms, sandwich norms and
embedding scale, soft-capping (Gemma 2), RoPE parameters per layer type (Gemma 3), NoPE
layers (SmolLM3's `no_rope_layers`), attention sinks and a top-k MoE (gpt-oss), a top-k MoE
of per-expert MLPs (Mixtral, Qwen MoE; Qwen2-MoE adds a gated shared expert), fused q/k/v and
gate/up projections (Phi-3, split or kept as the checkpoint stores them), queries scaled up
with position (Ministral 3's `llama_4_scaling_beta`). Which layers
slide comes from `layer_mix`, the reader the KV planner uses, so the attention masks and the
KV cache groups cannot disagree. Any of them may read other layers' KV caches
(`kv_sharing_target_layers`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import SLIDING
from hybridkv.models.layers.activations import clamped_swiglu
from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.moe import ExpertMLPs, MoE, Routing, StackedExperts
from hybridkv.models.layers.position_scaled_queries import PositionScaledQueryAttention
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.text_config import TextConfig
from hybridkv.models.weights import renamed, split_rows
from hybridkv.worker.attention.backend import AttentionParams

GEMMA_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text", "vaultgemma")
QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3", "gemma3_text")
TOPK_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
# Whose config classes tie the lm_head to the embedding when config.json does not say.
TIED_BY_DEFAULT = (*GEMMA_TYPES, "smollm3")
# Mixtral's checkpoints keep the MoE as `block_sparse_moe` with experts w1 (gate), w3 (up),
# w2 (down); the model here names them as the other MoE checkpoints do.
MIXTRAL_NAMES = ((r"\.block_sparse_moe\.", ".mlp."), (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
                 (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."),
                 (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."))


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


def topk_moe(cfg: TextConfig, num_experts: int) -> MoE:
    """Softmax over all experts, top k (renormalised for Mixtral, or where `norm_topk_prob`);
    Qwen2-MoE adds a shared expert scaled by sigmoid(shared_expert_gate(x))."""
    raw = cfg.raw
    size = int(raw.get("moe_intermediate_size") or cfg.intermediate_size)
    routing = Routing(int(raw["num_experts_per_tok"]), "softmax", renormalize=bool(
        raw.get("norm_topk_prob", cfg.model_type == "mixtral")))
    shared_size = int(raw.get("shared_expert_intermediate_size") or 0)
    shared = GatedMLP(cfg.hidden_size, shared_size, cfg.hidden_act) if shared_size else None
    return MoE(cfg.hidden_size, ExpertMLPs(num_experts, cfg.hidden_size, size, cfg.hidden_act),
               routing, router_name="gate", shared_expert=shared,
               shared_expert_gate=shared is not None)


def feed_forward(cfg: TextConfig, layer: int) -> nn.Module:
    raw = cfg.raw
    if cfg.model_type == "gpt_oss":
        return gpt_oss_moe(cfg)
    num_experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
    # Qwen MoE: dense MLPs on `mlp_only_layers` and off every `decoder_sparse_step`-th layer.
    if cfg.model_type in TOPK_MOE_TYPES and num_experts and \
            layer not in (raw.get("mlp_only_layers") or []) and \
            (layer + 1) % int(raw.get("decoder_sparse_step") or 1) == 0:
        return topk_moe(cfg, num_experts)
    fused = ("gate_up_proj", "down_proj") if cfg.model_type == "phi3" else None
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act,
                    bias=bool(raw.get("mlp_bias", False)), fused=fused)


def has_rope(cfg: TextConfig, layer: int) -> bool:
    """SmolLM3 leaves RoPE out of the layers whose `no_rope_layers` flag is 0."""
    flags = cfg.raw.get("no_rope_layers") if cfg.model_type == "smollm3" else None
    return not flags or bool(flags[layer])


def decoder_layer(cfg: TextConfig, layer: int, kind: str) -> DecoderLayer:
    gemma = cfg.model_type in GEMMA_TYPES
    scalar = cfg.raw.get("query_pre_attn_scalar")
    # Qwen2: biases on q/k/v, none on o_proj.
    biases: dict[str, Any] = dict(bias=bool(cfg.raw.get("qkv_bias", True)), o_bias=False) \
        if cfg.model_type in ("qwen2", "qwen2_moe") else {}
    shape = AttentionShape.from_config(cfg, qk_norm=cfg.model_type in QK_NORM_TYPES,
                                       norm_offset=1.0 if gemma else 0.0,
                                       sinks=cfg.model_type == "gpt_oss", **biases)
    params = AttentionParams(
        scale=(float(scalar) ** -0.5) if gemma and scalar else cfg.head_dim ** -0.5,
        softcap=cfg.raw.get("attn_logit_softcapping"),
        sliding_window=cfg.sliding_window if kind == SLIDING else None)
    rotary = Rotary.from_config(cfg.raw, cfg.head_dim, kind) if has_rope(cfg, layer) else None
    rope = cfg.raw.get("rope_parameters") or {}
    shared = layer in cfg.kv_targets
    attn = Attention(layer, shape, params, rotary=rotary, reads_shared_kv=shared) \
        if not rope.get("llama_4_scaling_beta") else PositionScaledQueryAttention(
            layer, shape, params, rotary=rotary, reads_shared_kv=shared,
            beta=float(rope["llama_4_scaling_beta"]),
            original_length=int(rope["original_max_position_embeddings"]))
    mlp = feed_forward(cfg, layer)
    # Gemma 2/3 normalise both sides of each sublayer ("sandwich"); VaultGemma only before.
    names = LayerNames("self_attn")
    if cfg.model_type == "vaultgemma":
        names = LayerNames("self_attn", ffn_norm="pre_feedforward_layernorm")
    elif gemma and cfg.model_type != "gemma":
        names = LayerNames("self_attn", ffn_norm="pre_feedforward_layernorm",
                           post_mixer_norm="post_attention_layernorm",
                           post_ffn_norm="post_feedforward_layernorm")
    return DecoderLayer(names, attn, [mlp], cfg.hidden_size, cfg.rms_norm_eps,
                        norm_offset=shape.norm_offset)


class DecoderForCausalLM(CausalLM):
    supports_kv_sharing = True

    def __init__(self, config: Mapping[str, Any]) -> None:
        text = config.get("text_config") or config
        cfg = TextConfig.from_hf(config, tied=text.get("model_type") in TIED_BY_DEFAULT)
        kinds = cfg.attention_kinds()
        gemma = cfg.model_type in GEMMA_TYPES
        super().__init__(cfg, (decoder_layer(cfg, i, k) for i, k in enumerate(kinds)),
                         norm_offset=1.0 if gemma else 0.0,
                         embed_scale=cfg.hidden_size ** 0.5 if gemma else None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        cfg = self.cfg
        if cfg.model_type == "mixtral":
            weights = renamed(weights, MIXTRAL_NAMES)
        if cfg.model_type == "phi3":
            # Phi-3 stores q, k and v as one `qkv_proj`; the attention here keeps them apart.
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            weights = split_rows(weights, "self_attn.qkv_proj.", {
                "self_attn.q_proj.": q, "self_attn.k_proj.": kv, "self_attn.v_proj.": kv})
        super().load_weights(weights)
