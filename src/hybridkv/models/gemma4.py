"""Gemma 4 text: sandwich-norm decoder layers with per-layer inputs, KV sharing, optional MoE.

What differs from Gemma 3n (whose attention and per-layer inputs it shares): no AltUp or
Laurel; full-attention layers have their own head size and KV heads (`per_layer_config`),
may take values equal to keys (`attention_k_eq_v`) and use "proportional" RoPE; layers that
read shared KV may have a double-width MLP; an MoE block can run next to the MLP; each layer's
output is scaled by a stored `layer_scalar`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.gemma3n import (
    KVSharingGemmaLM,
    PerLayerInputsModel,
    SharedKVAttention,
    gemma_rope,
    rms_normalize,
)
from hybridkv.models.layer_mix import (
    FULL,
    SLIDING,
    attention_shape,
    kv_sharing_targets,
    layer_kinds,
)
from hybridkv.models.layers import GatedMLP, RMSNorm, activation
from hybridkv.worker.forward_context import ForwardContext


class Router(nn.Module):
    """Softmax over experts of a scale-free-normed, rescaled input; top-k renormalised and
    multiplied by a learned per-expert scale."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))
        self.top_k, self.eps, self.root = top_k, eps, hidden ** -0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.proj(rms_normalize(x, self.eps) * self.scale * self.root)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


class Experts(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden, intermediate))
        self.act = activation(act)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
                ) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in experts.unique().tolist():
            token_idx, slot = torch.where(experts == expert)
            gate, up = nn.functional.linear(x[token_idx], self.gate_up_proj[expert]).chunk(2, -1)
            y = nn.functional.linear(self.act(gate) * up, self.down_proj[expert])
            out.index_add_(0, token_idx, (y * weights[token_idx, slot, None]).to(out.dtype))
        return out


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], layer: int, kind: str,
                 reads_shared_kv: bool) -> None:
        super().__init__()
        hidden = int(cfg["hidden_size"])
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        act = str(cfg.get("hidden_activation") or "gelu_pytorch_tanh")
        num_kv_heads, head_dim = attention_shape(cfg, layer, kind)
        self.self_attn = SharedKVAttention(
            cfg, layer, sliding=kind == SLIDING, head_dim=head_dim, num_kv_heads=num_kv_heads,
            reads_shared_kv=reads_shared_kv, rope=gemma_rope(cfg, kind == SLIDING),
            k_eq_v=bool(cfg.get("attention_k_eq_v", False)) and kind == FULL)
        wide = 2 if cfg.get("use_double_wide_mlp") and reads_shared_kv else 1
        self.mlp = GatedMLP(hidden, int(cfg["intermediate_size"]) * wide, act)
        for norm in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            setattr(self, norm, RMSNorm(hidden, eps))
        self.moe = bool(cfg.get("enable_moe_block"))
        if self.moe:
            num_experts = int(cfg["num_experts"])
            self.router = Router(hidden, num_experts, int(cfg["top_k_experts"]), eps)
            self.experts = Experts(hidden, int(cfg["moe_intermediate_size"]), num_experts, act)
            for norm in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                         "pre_feedforward_layernorm_2"):
                setattr(self, norm, RMSNorm(hidden, eps))
        per_layer = int(cfg.get("hidden_size_per_layer_input") or 0)
        if per_layer:
            self.act = activation(act)
            self.per_layer_input_gate = nn.Linear(hidden, per_layer, bias=False)
            self.per_layer_projection = nn.Linear(per_layer, hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))  # a buffer in the checkpoint

    def forward(self, h: torch.Tensor, per_layer_input: torch.Tensor | None,
                positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = h + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(h), positions, ctx))
        out = self.mlp(self.pre_feedforward_layernorm(h))
        if self.moe:
            weights, experts = self.router(h)  # routed on the residual stream
            moe = self.experts(self.pre_feedforward_layernorm_2(h), weights, experts)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(moe)
        h = h + self.post_feedforward_layernorm(out)
        if per_layer_input is not None:
            gated = self.act(self.per_layer_input_gate(h)) * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h * self.layer_scalar


class Gemma4Model(PerLayerInputsModel):
    def __init__(self, cfg: Mapping[str, Any], config: Mapping[str, Any]) -> None:
        self.has_per_layer_inputs = bool(cfg.get("hidden_size_per_layer_input"))
        if self.has_per_layer_inputs:
            super().__init__(cfg)
        else:
            nn.Module.__init__(self)
            self.hidden = int(cfg["hidden_size"])
        kinds = layer_kinds(config)
        self.targets = kv_sharing_targets(config, kinds)
        self.embed_tokens = nn.Embedding(int(cfg["vocab_size"]), self.hidden)
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(cfg, i, kinds[i][0], i in self.targets)
            for i in range(len(kinds)))
        self.norm = RMSNorm(self.hidden, float(cfg.get("rms_norm_eps", 1e-6)))


class Gemma4ForCausalLM(KVSharingGemmaLM):
    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = config.get("text_config") or config
        if cfg.get("use_bidirectional_attention") == "all":
            raise NotImplementedError("Gemma 4 with use_bidirectional_attention='all' (an "
                                      "encoder) is not supported; causal models only")
        super().__init__(config, Gemma4Model(cfg, config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        m = self.model
        h = m.embed_tokens(input_ids) * torch.tensor(m.hidden ** 0.5,
                                                     dtype=m.embed_tokens.weight.dtype)
        per_layer = m.per_layer_inputs(input_ids, h) if m.has_per_layer_inputs else None
        for i, layer in enumerate(m.layers):
            if i == self.kv_shared_from:
                ctx, keep = ctx.enter_kv_shared_layers()
                if keep is not None:
                    h, positions = h[keep], positions[keep]
                    per_layer = per_layer[keep] if per_layer is not None else None
            h = layer(h, per_layer[:, i] if per_layer is not None else None, positions, ctx)
        return m.norm(h)  # type: ignore[no-any-return]
