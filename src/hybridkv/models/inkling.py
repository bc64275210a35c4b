"""Inkling (text decoder): no RoPE; position comes only from a relative bias per query, and
short convolutions with a residual (layers/residual_conv.py) run on k, v and both residual
branches. Layers are full ("hybrid") or sliding ("hybrid_sliding", with their own head
sizes, swa_*):

    h = rms_norm(embed(ids))
    per layer:
        x = input_layernorm(h)
        q = q_norm(q_proj(x)); k = k_norm(kconv(k_proj(x))); v = vconv(v_proj(x))
        table = r_proj(x) [T, H, d_rel] @ proj [d_rel, E]        (E: rel_extent; sliding: window)
        full layers past log_scaling_n_floor: q, table *= 1 + alpha log((p + 1) / n_floor)
        h = h + attn_conv(o_proj(attention(q, k, v, scale 1 / D, bias table[t, h, p - j])))
        h = h + mlp_conv(mlp(post_attention_layernorm(h)))
    logits = lm_head(norm(h) / logits_mup_width_multiplier)

The MLP is dense (x global_scale) or a MoE: sigmoid scores (+ a correction bias) pick the
top-k routed experts; their logits and the shared experts' are normalised together as
sigmoids (the shared experts a sink of the weights), x route_scale x global_scale.
State per layer: the four convs' last inputs (the `sconv` kind of layer_mix)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import SLIDING, with_family_defaults
from hybridkv.models.layers.moe import StackedExperts, act_glu
from hybridkv.models.layers.normed_embedding import NormedEmbedding
from hybridkv.models.layers.norms import RMSNorm
from hybridkv.models.layers.relative_bias import RelativeLogits, log_scale
from hybridkv.models.layers.residual_conv import ResidualConv, StateRun, ready_states
from hybridkv.models.text_config import TextConfig
from hybridkv.worker.attention.backend import AttentionParams
from hybridkv.worker.forward_context import ForwardContext

# Indices of a layer's conv states (layer_mix's sconv spec, in this order).
K_CONV, V_CONV, ATTN_CONV, MLP_CONV = range(4)


class InklingAttention(nn.Module):
    def __init__(self, raw: Mapping[str, Any], layer: int, sliding: bool) -> None:
        super().__init__()
        hidden, prefix = int(raw["hidden_size"]), "swa_" if sliding else ""
        self.num_heads = int(raw[f"{prefix}num_attention_heads"])
        self.num_kv_heads = int(raw[f"{prefix}num_key_value_heads"])
        self.head_dim = d = int(raw[f"{prefix}head_dim"])
        kernel, eps = int(raw.get("conv_kernel_size") or 4), float(raw.get("rms_norm_eps", 1e-6))
        self.name = f"model.layers.{layer}.self_attn"
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=False)
        self.r_proj = nn.Linear(hidden, self.num_heads * int(raw["d_rel"]), bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=False)
        self.k_sconv = ResidualConv(self.num_kv_heads * d, kernel)
        self.v_sconv = ResidualConv(self.num_kv_heads * d, kernel)
        self.q_norm, self.k_norm = RMSNorm(d, eps), RMSNorm(d, eps)
        window = int(raw["sliding_window"])
        self.rel_logits_proj = RelativeLogits(int(raw["d_rel"]),
                                              window if sliding else int(raw["rel_extent"]))
        # q and k are RMS-normalised per head: 1 / D, not 1 / sqrt(D).
        self.params = AttentionParams(scale=1.0 / d, sliding_window=window if sliding else None)
        floor = raw.get("log_scaling_n_floor")
        self.log_scaling = None if sliding or floor is None else \
            (float(raw.get("log_scaling_alpha", 0.1)), float(floor))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                runs: list[StateRun]) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, d))
        k = self.k_norm(self.k_sconv(self.k_proj(x), runs, K_CONV).view(t, self.num_kv_heads, d))
        v = self.v_sconv(self.v_proj(x), runs, V_CONV).view(t, self.num_kv_heads, d)
        table = self.rel_logits_proj(self.r_proj(x).view(t, self.num_heads, -1))  # [T, H, E]
        if self.log_scaling is not None:
            tau = log_scale(positions, *self.log_scaling)  # float32, as the reference
            q = (q.float() * tau).to(q.dtype)
            table = (table.float() * tau).to(table.dtype)
        params = dataclasses.replace(self.params, query_bias=table)
        out = ctx.attention(self.name, q, k, v, params)
        return self.o_proj(out.flatten(1))  # type: ignore[no-any-return]


class InklingMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.global_scale = nn.Parameter(torch.ones(1))
        self.glu = act_glu(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))
        return y * self.global_scale


class SinkRouter(nn.Module):
    """x [T, hidden] -> (routed weights [T, k], expert ids [T, k], shared weights [T, S])."""

    def __init__(self, hidden: int, num_experts: int, num_shared: int, top_k: int,
                 route_scale: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts + num_shared, hidden))
        self.global_scale = nn.Parameter(torch.ones(1))
        # A parameter (not a buffer) so the loader finds it under its checkpoint name.
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts),
                                                    requires_grad=False)
        self.num_experts, self.top_k, self.route_scale = num_experts, top_k, route_scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = nn.functional.linear(x.float(), self.weight.float())  # float32 routing
        routed, shared = logits[:, :self.num_experts], logits[:, self.num_experts:]
        choice = routed.sigmoid() + self.e_score_correction_bias.float()
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        # Normalised sigmoids of the chosen and the shared logits, in log space as the
        # reference computes them.
        log_probs = nn.functional.logsigmoid(torch.cat([routed.gather(-1, ids), shared], -1))
        weights = torch.exp(log_probs - torch.logsumexp(log_probs, dim=-1, keepdim=True))
        weights = (weights * self.route_scale * self.global_scale.float()).to(x.dtype)
        return weights[:, :self.top_k], ids, weights[:, self.top_k:]


class SharedExperts(nn.Module):
    """The shared experts, stacked [S, ...]; each token's output weighted by its router."""

    def __init__(self, num_shared: int, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.zeros(num_shared, intermediate, hidden))
        self.up_proj = nn.Parameter(torch.zeros(num_shared, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.zeros(num_shared, hidden, intermediate))
        self.glu = act_glu(act)

    def forward(self, x: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
        gate = torch.einsum("th,sih->sti", x, self.gate_proj)
        up = torch.einsum("th,sih->sti", x, self.up_proj)
        act = self.glu(gate, up) * gammas.T[:, :, None]  # weighted before down, as reference
        down = torch.einsum("sti,shi->sth", act, self.down_proj)
        return down.float().sum(0).to(x.dtype)


class InklingMoE(nn.Module):
    def __init__(self, raw: Mapping[str, Any], act: str) -> None:
        super().__init__()
        hidden, width = int(raw["hidden_size"]), int(raw["moe_intermediate_size"])
        num_experts, num_shared = int(raw["n_routed_experts"]), int(raw["n_shared_experts"])
        self.gate = SinkRouter(hidden, num_experts, num_shared, int(raw["num_experts_per_tok"]),
                               float(raw.get("route_scale", 1.0)))
        self.experts = StackedExperts(num_experts, hidden, width, act_glu(act))
        self.shared_experts = SharedExperts(num_shared, hidden, width, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids, gammas = self.gate(x)
        routed: torch.Tensor = self.experts(x, weights, ids)
        shared: torch.Tensor = self.shared_experts(x, gammas)
        return routed + shared


class InklingLayer(nn.Module):
    def __init__(self, cfg: TextConfig, raw: Mapping[str, Any], layer: int, kind: str) -> None:
        super().__init__()
        hidden, kernel = cfg.hidden_size, int(raw.get("conv_kernel_size") or 4)
        self.self_attn = InklingAttention(raw, layer, kind == SLIDING)
        dense = (raw.get("mlp_layer_types") or ["sparse"] * cfg.num_layers)[layer] == "dense"
        self.mlp: nn.Module = InklingMLP(hidden, cfg.intermediate_size, cfg.hidden_act) \
            if dense else InklingMoE(raw, cfg.hidden_act)
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.attn_sconv = ResidualConv(hidden, kernel)
        self.mlp_sconv = ResidualConv(hidden, kernel)
        self.state_name = f"model.layers.{layer}.mamba"  # the conv states in the KV layout

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        runs = ready_states(*ctx.state(self.state_name))
        x = self.self_attn(self.input_layernorm(h), positions, ctx, runs)
        h = h + self.attn_sconv(x, runs, ATTN_CONV)
        x = self.mlp(self.post_attention_layernorm(h))
        return h + self.mlp_sconv(x, runs, MLP_CONV)  # type: ignore[no-any-return]


class InklingForCausalLM(CausalLM):
    unused_prefixes = ("model.mtp.",)  # multi-token-prediction layers: not run here
    refused_cache_dtypes = {"q4": "Inkling's relative bias per query reads K/V pages in "
                                  "full precision or int8"}

    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config)
        raw = with_family_defaults(cfg.raw)
        if raw.get("unpadded_vocab_size") not in (None, cfg.vocab_size):
            raise NotImplementedError(f"inkling: unpadded_vocab_size "
                                      f"{raw['unpadded_vocab_size']} != vocab_size "
                                      f"{cfg.vocab_size} (a padded head) is not supported")
        # logits = lm_head(h / m): the µP width multiplier as a logits multiplier (configs
        # may spell it embedding_multiplier, transformers' alias; embeddings are not scaled).
        mup = raw.get("logits_mup_width_multiplier") or raw.get("embedding_multiplier") or 24.0
        cfg = dataclasses.replace(cfg, logits_multiplier=1.0 / float(mup),
                                  embedding_multiplier=1.0)
        kinds = [parts[0] for parts in cfg.layer_kinds]
        super().__init__(cfg, (InklingLayer(cfg, raw, i, k) for i, k in enumerate(kinds)))
        self.model.embed_tokens = NormedEmbedding(cfg.vocab_size, cfg.hidden_size,
                                                  cfg.rms_norm_eps)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_transformers_layout(weights))


def _transformers_layout(weights: Iterable[tuple[str, torch.Tensor]]
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, refused in one line when they are in the original layout
    (`model.llm.*`, gate and up interleaved in w13): only transformers' layout is read."""
    for name, tensor in weights:
        if name.startswith("model.llm."):
            raise ValueError(f"inkling: checkpoint tensor {name!r} is in the original "
                             f"layout; only transformers' (InklingForCausalLM.save_pretrained"
                             f") is supported")
        yield name, tensor
