"""The Llama family of decoders: Llama, Qwen3, Mistral, Gemma 2, Gemma 3 text and gpt-oss.

They differ in a handful of switches read from the config: q/k norms (Qwen3, Gemma 3),
Gemma's `(1 + w)` norms, sandwich norms and embedding scale, soft-capping (Gemma 2), RoPE
parameters per layer type (Gemma 3), attention sinks and a top-k MoE (gpt-oss). Which layers
slide comes from `layer_mix`, the reader the KV planner uses, so the attention masks and the
KV cache groups cannot disagree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridkv.models.layer_mix import (
    CHUNKED,
    FULL,
    SLIDING,
    kv_shared_from,
    kv_sharing_targets,
    layer_kinds,
)
from hybridkv.models.layers import RMSNorm, activation, apply_rope, rope_inv_freq, rope_key
from hybridkv.models.weights import load_named_weights
from hybridkv.worker.attention import AttentionParams
from hybridkv.worker.forward_context import ForwardContext

GEMMA_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text")


@dataclass(frozen=True)
class MoEConfig:
    """gpt-oss experts: softmax over the top-k router logits, clamped SwiGLU with biases."""

    num_experts: int
    top_k: int
    swiglu_alpha: float
    swiglu_limit: float


@dataclass(frozen=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    attention_bias: bool
    layer_kinds: tuple[str, ...]  # full / sliding / chunked per layer
    sliding_window: int | None
    rope_params: tuple[Mapping[str, Any], ...]  # per layer
    qk_norm: bool
    gemma: bool  # (1 + w) norms, sandwich norms, embedding scale
    query_scale: float
    attn_softcap: float | None
    final_softcap: float | None
    sinks: bool = False
    moe: MoEConfig | None = None
    # Per layer: the layer whose KV cache it reads (KV sharing), or None.
    kv_targets: tuple[int | None, ...] = ()

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> DecoderConfig:
        cfg = config.get("text_config") or config
        model_type = str(cfg["model_type"])
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        all_kinds = layer_kinds(config)
        kinds = tuple(parts[0] if parts else FULL for parts in all_kinds)
        targets = kv_sharing_targets(config, all_kinds)
        if any(k not in (FULL, SLIDING) for k in kinds):
            raise NotImplementedError(f"{model_type}: layer kinds {set(kinds)} are not "
                                      f"supported by the Llama-family decoder")
        gemma = model_type in GEMMA_TYPES
        scalar = cfg.get("query_pre_attn_scalar")
        return cls(
            model_type=model_type, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings",
                                                cfg.get("tie_word_embeddings", False))),
            attention_bias=bool(cfg.get("attention_bias", False)),
            layer_kinds=kinds, sliding_window=cfg.get("sliding_window"),
            rope_params=tuple(_rope_params(cfg, kind) for kind in kinds),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text"),
            gemma=gemma,
            query_scale=(float(scalar) ** -0.5) if gemma and scalar else head_dim ** -0.5,
            attn_softcap=cfg.get("attn_logit_softcapping"),
            final_softcap=cfg.get("final_logit_softcapping"),
            sinks=model_type == "gpt_oss",
            moe=MoEConfig(num_experts=int(cfg["num_local_experts"]),
                          top_k=int(cfg["num_experts_per_tok"]),
                          swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                          swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
            if model_type == "gpt_oss" else None,
            kv_targets=tuple(targets.get(i) for i in range(len(kinds))))


def _rope_params(cfg: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    """RoPE parameters of a layer, from the newer `rope_parameters` (possibly keyed by layer
    type) or the older `rope_theta` / `rope_scaling` / `rope_local_base_freq`."""
    params = cfg.get("rope_parameters")
    layer_type = "sliding_attention" if kind == SLIDING else "full_attention"
    if isinstance(params, Mapping):
        return dict(params.get(layer_type, params))
    out: dict[str, Any] = dict(cfg.get("rope_scaling") or {})
    out["rope_theta"] = cfg.get("rope_theta", 10000.0)
    if kind == SLIDING and cfg.get("rope_local_base_freq"):
        out = {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}
    return out


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int) -> None:
        super().__init__()
        self.name = f"model.layers.{layer}.self_attn"
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        bias = cfg.attention_bias
        # A layer reading another layer's KV cache computes only queries.
        self.reads_shared_kv = bool(cfg.kv_targets) and cfg.kv_targets[layer] is not None
        writes_kv = not self.reads_shared_kv
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim,
                                bias=bias) if writes_kv else None
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim,
                                bias=bias) if writes_kv else None
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        offset = 1.0 if cfg.gemma else 0.0
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset) if (
            cfg.qk_norm and writes_kv) else None
        inv_freq, self.rope_scaling = rope_inv_freq(cfg.head_dim, cfg.rope_params[layer])
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # Layers with equal RoPE parameters share one cos/sin per step.
        self.rope_key = rope_key(cfg.head_dim, cfg.rope_params[layer])
        # Learned per-head sink logits (gpt-oss): part of the softmax, attached to no value.
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.sinks else None
        self.sliding_window = cfg.sliding_window if cfg.layer_kinds[layer] == SLIDING else None
        self.scale, self.softcap = cfg.query_scale, cfg.attn_softcap

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        # h [T, hidden] -> q [T, Hq, D], k/v [T, Hk, D]
        q = self.q_proj(h).unflatten(-1, (self.num_heads, self.head_dim))
        if self.q_norm is not None:
            q = self.q_norm(q)
        cos, sin = ctx.rope_cos_sin(positions, self.rope_key, self.inv_freq, self.rope_scaling)
        q = apply_rope(q, cos, sin)
        k = v = None
        if self.k_proj is not None and self.v_proj is not None:
            k = self.k_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim))
            v = self.v_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim))
            if self.k_norm is not None:
                k = self.k_norm(k)
            k = apply_rope(k, cos, sin)
        params = AttentionParams(scale=self.scale, softcap=self.softcap,
                                 sliding_window=self.sliding_window, sinks=self.sinks)
        out = ctx.attention(self.name, q, k, v, params)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, cfg: DecoderConfig, moe: MoEConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(moe.num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.zeros(moe.num_experts))


class Experts(nn.Module):
    """Fused expert weights as gpt-oss checkpoints store them: gate and up interleaved."""

    def __init__(self, cfg: DecoderConfig, moe: MoEConfig) -> None:
        super().__init__()
        e, h, i = moe.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i))
        self.down_proj = nn.Parameter(torch.zeros(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h))


class MoE(nn.Module):
    def __init__(self, cfg: DecoderConfig, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.router = Router(cfg, moe)
        self.experts = Experts(cfg, moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, hidden]: each token goes to its top-k experts, weighted by a softmax over them.
        logits = nn.functional.linear(x, self.router.weight, self.router.bias)
        top_logits, top_ids = torch.topk(logits, self.moe.top_k, dim=-1)  # [T, k]
        weights = torch.softmax(top_logits, dim=-1)
        out = torch.zeros_like(x)
        ex, limit = self.experts, self.moe.swiglu_limit
        for expert in top_ids.unique().tolist():
            token_idx, slot = torch.where(top_ids == expert)
            gate_up = x[token_idx] @ ex.gate_up_proj[expert] + ex.gate_up_proj_bias[expert]
            gate = gate_up[..., ::2].clamp(max=limit)
            up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
            glu = gate * torch.sigmoid(gate * self.moe.swiglu_alpha)
            y = ((up + 1) * glu) @ ex.down_proj[expert] + ex.down_proj_bias[expert]
            out.index_add_(0, token_idx, y * weights[token_idx, slot, None])
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int) -> None:
        super().__init__()
        offset = 1.0 if cfg.gemma else 0.0
        self.self_attn = Attention(cfg, layer)
        self.mlp: nn.Module = MoE(cfg, cfg.moe) if cfg.moe else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        # Gemma 2/3 normalise both sides of each sublayer ("sandwich").
        self.sandwich = cfg.gemma and cfg.model_type != "gemma"
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                      offset)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        if self.sandwich:
            h = h + self.post_attention_layernorm(
                self.self_attn(self.input_layernorm(h), positions, ctx))
            return h + self.post_feedforward_layernorm(
                self.mlp(self.pre_feedforward_layernorm(h)))
        h = h + self.self_attn(self.input_layernorm(h), positions, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, 1.0 if cfg.gemma else 0.0)


class DecoderForCausalLM(nn.Module):
    """forward(token ids [T], positions [T], ctx) -> hidden [T, hidden];
    compute_logits(hidden [N, hidden]) -> [N, vocab]."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        targets = {i: t for i, t in enumerate(cfg.kv_targets) if t is not None}
        self.kv_shared_from = kv_shared_from(targets, cfg.num_layers)
        # Checkpoints written by transformers keep k/v weights for layers that read another
        # layer's KV (it has no notion of the map); nothing uses them here.
        self.unused_weights = tuple(
            f"model.layers.{i}.self_attn.{part}." for i in targets
            for part in ("k_proj", "v_proj", "k_norm"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        if self.cfg.gemma:
            h = h * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=h.dtype)
        for i, layer in enumerate(self.model.layers):
            if i == self.kv_shared_from:
                ctx, keep = ctx.enter_kv_shared_layers()
                if keep is not None:
                    h, positions = h[keep], positions[keep]
            h = layer(h, positions, ctx)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.cfg.final_softcap is not None:
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights, model_type=self.cfg.model_type,
                           tied=self.cfg.tie_word_embeddings, unused=self.unused_weights)


__all__ = ["CHUNKED", "DecoderConfig", "DecoderForCausalLM"]
