"""Qwen4-Exp's text decoder: Gated DeltaNet on "linear_attention" layers (its projections
stored apart, as Qwen3.5's), gated attention on "indexed_attention" layers reading only
what a query-sparse indexer (QSA; worker/attention/qsa.py) selects for each query, a top-k MoE with
a sigmoid-gated shared expert on every layer, and hyper-connections around each sublayer
(layers/hyper_connection.py): the residual stream is `hc_count` copies of the hidden state
and an output mixer, not a final norm, turns it into the logits' input.

The indexer (one key head):

    q_i | k_i = index_qk_proj(h);  q_i = RoPE(q_layernorm(q_i))         [T, Hi, Di]
    k_i       -> the IndexerKeySpec pages, raw, one per position
    block key = RoPE_at_block_start(k_layernorm(mean of the block's raw keys))

Refused: per-layer n-gram embeddings (`ple_layer_ids`), a sigmoid output gate on the
DeltaNet norm (`output_gate_type`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import LINEAR
from hybridkv.models.layers.gated_deltanet_split import SplitGatedDeltaNet
from hybridkv.models.layers.hyper_connection import HyperConnection
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.moe import ExpertMLPs, MoE, Routing
from hybridkv.models.layers.norms import RMSNorm
from hybridkv.models.layers.rotary import Rotary, apply_rope
from hybridkv.models.text_config import TextConfig
from hybridkv.worker.attention.backend import AttentionParams
from hybridkv.worker.attention.qsa import QSAParams, qsa_attention, select_blocks
from hybridkv.worker.attention.sparse_mla import Selection, write_rows
from hybridkv.worker.forward_context import ForwardContext, rope_cos_sin

INDEXER_FIELDS = ("indexer_n_heads", "indexer_head_dim", "indexer_budget",
                  "indexer_compress_ratio")


def rope_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with its first cos.shape[-1] dims rotated (half-split)."""
    d = cos.shape[-1]
    return torch.cat([apply_rope(x[..., :d], cos, sin), x[..., d:]], dim=-1)


class QSAIndexer(nn.Module):
    """forward(h, cos/sin of the step, the layer's RoPE, ctx) -> each request's selection;
    writes this step's raw keys first."""

    def __init__(self, cfg: Mapping[str, Any], layer: int) -> None:
        super().__init__()
        self.name = f"model.layers.{layer}.self_attn.indexer"
        self.num_heads, self.head_dim = int(cfg["indexer_n_heads"]), int(cfg["indexer_head_dim"])
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.index_qk_proj = nn.Linear(int(cfg["hidden_size"]),
                                       (self.num_heads + 1) * self.head_dim, bias=False)
        self.q_layernorm = RMSNorm(self.head_dim, eps, 1.0)
        self.k_layernorm = RMSNorm(self.head_dim, eps, 1.0)
        ratio = int(cfg["indexer_compress_ratio"])
        self.params = QSAParams(block_top_k=int(cfg["indexer_budget"]) // ratio,
                                compress_ratio=ratio)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary: Rotary, ctx: ForwardContext) -> list[Selection]:
        q, k = self.index_qk_proj(h).split([self.num_heads * self.head_dim, self.head_dim],
                                           dim=-1)
        q = rope_first(self.q_layernorm(q.unflatten(-1, (self.num_heads, -1))), cos, sin)
        meta = ctx.metadata[ctx.layer_group[self.name]]
        keys = ctx.kv_caches[self.name]
        write_rows(keys, meta, k)

        def pool(raw: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
            # [NB, r, Di] -> [NB, Di]: averaged in float32, normed, rotated by its block's
            # first position.
            pooled = self.k_layernorm(raw.float().mean(dim=1).to(raw.dtype))
            cos_b, sin_b = rope_cos_sin(starts, rotary.inv_freq, rotary.scaling)
            return rope_first(pooled[:, None], cos_b, sin_b)[:, 0]

        return select_blocks(q, keys, meta, self.params, pool)


class QSAAttention(nn.Module):
    """Gated attention (q_proj also yields a sigmoid gate per channel; q/k normed per head;
    RoPE on part of each head) over the indexer's selection."""

    def __init__(self, cfg: Mapping[str, Any], layer: int) -> None:
        super().__init__()
        self.name = f"model.layers.{layer}.self_attn"
        hidden, bias = int(cfg["hidden_size"]), bool(cfg.get("attention_bias", False))
        self.num_heads, self.num_kv_heads = int(cfg["num_attention_heads"]), int(
            cfg["num_key_value_heads"])
        self.head_dim = int(cfg.get("head_dim") or hidden // self.num_heads)
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.q_proj = nn.Linear(hidden, 2 * self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps, 1.0)
        self.k_norm = RMSNorm(self.head_dim, eps, 1.0)
        self.params = AttentionParams(scale=self.head_dim ** -0.5)
        self.rotary = Rotary(self.head_dim, cfg.get("rope_parameters") or {
            "rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)})
        self.indexer = QSAIndexer(cfg, layer)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        tokens = h.shape[0]
        # Per head [q | gate], as the checkpoint lays q_proj's rows out.
        q, gate = self.q_proj(h).unflatten(-1, (self.num_heads, 2 * self.head_dim)).chunk(
            2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim)))
        v = self.v_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim))
        cos, sin = self.rotary.cos_sin(positions, ctx)
        q, k = rope_first(q, cos, sin), rope_first(k, cos, sin)
        selections = self.indexer(h, cos, sin, self.rotary, ctx)
        ctx.write_kv(self.name, k, v, self.params)
        out = qsa_attention(q, ctx.kv_caches[self.name],
                            ctx.metadata[ctx.layer_group[self.name]], selections,
                            self.params.scale)
        out = out.reshape(tokens, -1) * torch.sigmoid(gate.reshape(tokens, -1))
        return self.o_proj(out)  # type: ignore[no-any-return]


def sparse_moe(raw: Mapping[str, Any], hidden: int, act: str) -> MoE:
    experts = ExpertMLPs(int(raw["num_experts"]), hidden, int(raw["moe_intermediate_size"]),
                         act)
    routing = Routing(int(raw["num_experts_per_tok"]), "softmax",
                      renormalize=bool(raw.get("norm_topk_prob", True)))
    return MoE(hidden, experts, routing, router_name="gate",
               shared_expert=GatedMLP(hidden, int(raw["shared_expert_intermediate_size"]), act),
               shared_expert_gate=True)


class Qwen4ExpLayer(nn.Module):
    """h [T, hc_count x hidden] -> the same: the mixer, then the MoE, each through its
    hyper-connection (no other norms)."""

    def __init__(self, cfg: TextConfig, layer: int, kind: str | None) -> None:
        super().__init__()
        raw = cfg.raw
        count, rank = int(raw.get("hc_count", 4)), int(raw.get("hc_lowrank", 320))
        self.mixer_name = "linear_attn" if kind == LINEAR else "self_attn"
        self.add_module(self.mixer_name, SplitGatedDeltaNet(raw, layer) if kind == LINEAR
                        else QSAAttention(raw, layer))
        self.mlp = sparse_moe(raw, cfg.hidden_size, cfg.hidden_act)
        self.attn_hyper_connection = HyperConnection(cfg.hidden_size, count, rank,
                                                     cfg.rms_norm_eps)
        self.mlp_hyper_connection = HyperConnection(cfg.hidden_size, count, rank,
                                                    cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        mixer = getattr(self, self.mixer_name)
        h = self.attn_hyper_connection(h, lambda x: mixer(x, positions, ctx))
        return self.mlp_hyper_connection(h, self.mlp)  # type: ignore[no-any-return]


class Qwen4ExpForCausalLM(CausalLM):
    refused_cache_dtypes = {
        "q4": "qwen4_exp's query-sparse attention reads the K/V rows its indexer selects, "
              "and q4 keys are quantized per channel over groups of 16 tokens, which it does "
              "not read; use kv_cache_dtype int8 or auto"}

    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config, eps=1e-6)
        raw = cfg.raw
        if raw.get("ple_layer_ids"):
            raise NotImplementedError("qwen4_exp: per-layer n-gram embeddings (ple_layer_ids) "
                                      "are not supported; accepted: []")
        if (raw.get("output_gate_type") or cfg.hidden_act) != "silu":
            raise NotImplementedError(f"qwen4_exp: output_gate_type "
                                      f"{raw.get('output_gate_type')!r} is not supported; "
                                      f"accepted: silu")
        missing = [f for f in INDEXER_FIELDS if raw.get(f) is None]
        if missing:
            # transformers builds every attention layer with its indexer.
            raise ValueError(f"qwen4_exp: the QSA indexer's {', '.join(missing)} missing "
                             f"(its attention layers need them)")
        super().__init__(cfg, (Qwen4ExpLayer(cfg, i, k) for i, k in enumerate(cfg.kinds)))
        self.hc_count = int(raw.get("hc_count", 4))
        # No final norm: the output mixer's stream norm is the last one.
        self.model.norm = nn.Identity()
        self.model.hyper_connection_mixer = HyperConnection(
            cfg.hidden_size, self.hc_count, int(raw.get("hc_lowrank", 320)), cfg.rms_norm_eps,
            inject=False)

    def enter_layers(self, h: torch.Tensor) -> torch.Tensor:
        return h.repeat(1, self.hc_count)  # [T, hc_count x hidden]: the copies, in order

    def leave_layers(self, h: torch.Tensor) -> torch.Tensor:
        mixer = self.model.hyper_connection_mixer
        assert isinstance(mixer, HyperConnection)
        return mixer.mix(h)
