"""dots3_note's text decoder: multi-head latent attention on every layer (sliding-window MLA
on "sliding_attention" layers, with their own MLA sizes in `per_layer_config`), a lightning
indexer choosing each query's top `index_topk` positions on "indexed_attention" layers
(DeepSeek-V3.2's DSA; worker/attention/sparse_mla.py), a dense MLP on "dense" layers and
DeepSeek-V3-style grouped routed experts plus shared experts on "sparse" ones.

Its MLA differs from DeepSeek's (layers/mla.py) in three rescalings and a norm:

    q_resid = q_a_layernorm(q_a_proj(h)) * sqrt(hidden / q_lora_rank)   (also the indexer's)
    c_kv    = kv_a_layernorm(c_kv) * sqrt(hidden / kv_lora_rank)
    k_pe    = RoPE(k_rope_only_layernorm(k_pe))                          interleaved pairs
    out     = o_proj(attention(q, k, v) x sigmoid(g_proj(h)) per head)

The indexer (all in float32 where the reference is):

    q_i    = RoPE(wq_b(q_resid))      [T, Hi, Di], RoPE on the first qk_rope_head_dim dims
    k_i    = RoPE(k_norm(wk(h)))      [T, Di], the IndexerKeySpec pages' rows
    w      = weights_proj(h)          [T, Hi]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import dots3_defaults, layer_config
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.grouped_topk import GroupedTopKRouter, SharedExpertsMoE
from hybridkv.models.layers.mla import rope_interleaved
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.moe import ExpertMLPs
from hybridkv.models.layers.norms import RMSNorm
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.text_config import TextConfig
from hybridkv.worker.attention.mla import MLAParams
from hybridkv.worker.attention.sparse_mla import (
    IndexerParams,
    Selection,
    select_top_k,
    sparse_mla_forward,
    write_rows,
)
from hybridkv.worker.forward_context import ForwardContext


def layer_rotary(cfg: Mapping[str, Any], layer: int, layer_type: str) -> Rotary:
    """RoPE of a layer: its type's `rope_parameters`, over int(head_dim x
    partial_rotary_factor) dims of the layer's head_dim, as the reference sizes it."""
    params = cfg.get("rope_parameters") or {"rope_type": "default",
                                             "rope_theta": cfg.get("rope_theta", 10000.0)}
    params = dict(params.get(layer_type, params))
    return Rotary(int(layer_config(cfg, layer)["head_dim"]), params)


class LightningIndexer(nn.Module):
    """forward(h [T, hidden], q_resid [T, q_lora_rank], cos/sin, ctx) -> each request's
    selection; writes this step's indexer keys first (a query may select itself)."""

    def __init__(self, cfg: Mapping[str, Any], layer: int) -> None:
        super().__init__()
        self.name = f"model.layers.{layer}.self_attn.indexer"
        hidden, q_rank = int(cfg["hidden_size"]), int(cfg["q_lora_rank"])
        self.num_heads, self.head_dim = int(cfg["index_n_heads"]), int(cfg["index_head_dim"])
        self.rope_dim = int(cfg["qk_rope_head_dim"])
        self.wq_b = nn.Linear(q_rank, self.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hidden, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, self.num_heads, bias=False)
        self.params = IndexerParams(top_k=int(cfg["index_topk"]),
                                    scale=self.head_dim ** -0.5,
                                    weight_scale=self.num_heads ** -0.5)

    def forward(self, h: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, ctx: ForwardContext) -> list[Selection]:
        r = self.rope_dim
        q = self.wq_b(q_resid).unflatten(-1, (self.num_heads, self.head_dim))
        # The indexer's RoPE dims come first (the attention's come last).
        q = torch.cat([rope_interleaved(q[..., :r], cos, sin), q[..., r:]], dim=-1)
        k = self.k_norm(self.wk(h))  # [T, Di]
        k = torch.cat([rope_interleaved(k[:, None, :r], cos, sin)[:, 0], k[:, r:]], dim=-1)
        meta = ctx.metadata[ctx.layer_group[self.name]]
        keys = ctx.kv_caches[self.name]
        write_rows(keys, meta, k)
        return select_top_k(q, self.weights_proj(h), keys, meta, self.params)


class Dots3Attention(nn.Module):
    """forward(h [T, hidden], positions [T], ctx) -> [T, hidden]: MLA over the layer's
    window, its indexer's selection, or everything (the module docstring)."""

    def __init__(self, cfg: Mapping[str, Any], layer: int, layer_type: str) -> None:
        super().__init__()
        self.name = f"model.layers.{layer}.self_attn"
        lc = layer_config(cfg, layer)
        if lc.get("q_lora_rank") is None:
            raise NotImplementedError("dots3_note: q_lora_rank null (queries without the "
                                      "low-rank bottleneck) is not supported")
        hidden, heads = int(cfg["hidden_size"]), int(lc["num_attention_heads"])
        q_rank, self.rank = int(lc["q_lora_rank"]), int(lc["kv_lora_rank"])
        self.rope_dim, nope = int(lc["qk_rope_head_dim"]), int(lc["qk_nope_head_dim"])
        v_dim, eps = int(lc["v_head_dim"]), float(lc.get("rms_norm_eps", 1e-5))
        bias = bool(lc.get("attention_bias", False))
        sliding = layer_type == "sliding_attention"
        self.params = MLAParams(scale=(nope + self.rope_dim) ** -0.5, num_heads=heads,
                                kv_lora_rank=self.rank, qk_nope_head_dim=nope, v_head_dim=v_dim,
                                sliding_window=int(lc["sliding_window"]) if sliding else None)
        self.q_a_proj = nn.Linear(hidden, q_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(q_rank, eps)
        self.q_b_proj = nn.Linear(q_rank, heads * (nope + self.rope_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, eps)
        self.kv_b_proj = nn.Linear(self.rank, heads * (nope + v_dim), bias=False)
        self.o_proj = nn.Linear(heads * v_dim, hidden, bias=bias)
        self.k_rope_only_layernorm = RMSNorm(self.rope_dim, eps)
        self.g_proj = nn.Linear(hidden, heads, bias=False)
        self.q_lora_scale = (hidden / q_rank) ** 0.5
        self.kv_lora_scale = (hidden / self.rank) ** 0.5
        self.rotary = layer_rotary(cfg, layer, layer_type)
        self.indexer = LightningIndexer(lc, layer) if layer_type == "indexed_attention" \
            else None

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        nope = self.params.qk_nope_head_dim
        q_resid = self.q_a_layernorm(self.q_a_proj(h)) * self.q_lora_scale
        q = self.q_b_proj(q_resid).unflatten(-1, (self.params.num_heads, -1))
        c_kv, k_pe = self.kv_a_proj_with_mqa(h).split([self.rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv) * self.kv_lora_scale
        cos, sin = self.rotary.cos_sin(positions, ctx)
        q = torch.cat([q[..., :nope], rope_interleaved(q[..., nope:], cos, sin)], dim=-1)
        k_pe = rope_interleaved(self.k_rope_only_layernorm(k_pe)[:, None], cos, sin)[:, 0]
        latent = torch.cat([c_kv, k_pe], dim=-1)  # [T, rank + rope]
        if self.indexer is None:
            out = ctx.mla_attention(self.name, q, latent, self.kv_b_proj.weight, self.params)
        else:
            selections = self.indexer(h, q_resid, cos, sin, ctx)
            out = sparse_mla_forward(q, latent, ctx.kv_caches[self.name],
                                     ctx.metadata[ctx.layer_group[self.name]], selections,
                                     self.kv_b_proj.weight, self.params)
        out = out * torch.sigmoid(self.g_proj(h).float()).to(h.dtype)[..., None]
        return self.o_proj(out.flatten(1))  # type: ignore[no-any-return]


def routed_experts(raw: Mapping[str, Any], hidden: int, act: str) -> SharedExpertsMoE:
    num_experts = int(raw["n_routed_experts"])
    gate = GroupedTopKRouter(
        hidden, num_experts, int(raw["num_experts_per_tok"]),
        num_groups=int(raw.get("n_group") or 1), topk_groups=int(raw.get("topk_group") or 1),
        renormalize=bool(raw.get("norm_topk_prob", True)),
        scale=float(raw.get("routed_scaling_factor") or 1.0))
    # Shared experts are as wide as all of them together, not moe_intermediate_size.
    shared = int(raw.get("shared_experts_intermediate_size") or 1536) * int(
        raw.get("n_shared_experts") or 1)
    return SharedExpertsMoE(hidden, gate, ExpertMLPs(num_experts, hidden,
                                                     int(raw["moe_intermediate_size"]), act),
                            GatedMLP(hidden, shared, act))


def dots3_layer(cfg: TextConfig, layer: int) -> DecoderLayer:
    raw = cfg.raw
    layer_type = str(raw["layer_types"][layer])
    types = raw.get("mlp_layer_types")
    sparse = types[layer] == "sparse" if types else layer >= int(
        raw.get("first_k_dense_replace", 1))
    mlp = routed_experts(raw, cfg.hidden_size, cfg.hidden_act) if sparse else GatedMLP(
        cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
    return DecoderLayer(LayerNames("self_attn"), Dots3Attention(raw, layer, layer_type), [mlp],
                        cfg.hidden_size, cfg.rms_norm_eps)


class Dots3NoteForCausalLM(CausalLM):
    # The released checkpoint's multi-token-prediction head, which generation does not run.
    unused_prefixes = ("model.mtp.",)

    def __init__(self, config: Mapping[str, Any]) -> None:
        raw = dots3_defaults(config.get("text_config") or config)
        cfg = TextConfig.from_hf(raw, eps=1e-5)
        super().__init__(cfg, (dots3_layer(cfg, i) for i in range(cfg.num_layers)))
