"""Inkling 2 (text decoder): Inkling's relative bias per query and short convolutions, with
a sink logit per token, an output gate, L2-clipped q / k / relative states, RMS-normed
values, and "attention residuals" in place of a plain residual stream:

    per layer i (sliding, or full every 6th by default):
        x = attention_input(blocks, h) (layer 0: h)    full layers: three inputs (q, k, v)
        a = attn_conv(attention(x))
        boundary layers (i % n_layers_per_attn_res_block == 0): blocks += [h]; r = a
        else: r = h + a
        h' = r + mlp_conv(moe(post_attention_layernorm(mlp_input(blocks, r))))
    logits = softcap(lm_head(norm(final_input(blocks, h))))[:unpadded_vocab_size]

    attention_input / mlp_input / final_input (BlockRead): learned queries attending over
    the RMS-normalised [blocks..., x] of each token (softmax over them, scale 1/sqrt(hidden))

    attention: q = clip(q_proj(x) * scale_q), k = clip(kconv(k_proj(x))), v = rms(vconv(v_proj))
               r = clip(r_proj(x) * scale_r); full layers: q, r *= 1 + a log((p+1) / n_floor)
               out = o_proj(sigmoid(gate_proj(x)) * attention(q, k, v, bias r @ proj,
                                                              sink sink_proj(x)))
    sliding layers' k/v convs are plain (layers/residual_conv.py, / sqrt(K + 1)); full
    layers' take per-token taps (DynamicConv, / sqrt(2K + 1)) from their own inputs.

The stream between layers carries the block summaries: [T, blocks + 1, hidden], h last.
Checkpoints use the original names (`model.llm.layers.N.attn.wq_du`, ...), renamed at load
(`_CHECKPOINT_NAMES`)."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import SLIDING, with_family_defaults
from hybridkv.models.layers.moe import StackedExperts
from hybridkv.models.layers.normed_embedding import NormedEmbedding
from hybridkv.models.layers.norms import RMSNorm
from hybridkv.models.layers.relative_bias import RelativeLogits, log_scale
from hybridkv.models.layers.residual_conv import ResidualConv, StateRun, conv_window, ready_states
from hybridkv.models.text_config import TextConfig
from hybridkv.worker.attention.backend import AttentionParams
from hybridkv.worker.forward_context import ForwardContext

K_CONV, V_CONV, ATTN_CONV, MLP_CONV = range(4)  # the layer's conv states (layer_mix sconv)

# transformers' Inkling2TextConfig defaults, for configs that leave fields out.
DEFAULTS: dict[str, Any] = dict(
    qk_l2_clip_threshold=22.627416997969522, rel_l2_clip_threshold=8.0,
    log_scaling_n_floor=128000, log_scaling_alpha=0.1, n_layers_per_attn_res_block=6,
    mlp_gate_softcap=4.0, mlp_up_softcap=25.0, final_logit_softcapping=30.0,
    route_scale=8.0, scoring_func="sigmoid", conv_kernel_size=4)


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def l2_clip(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Head vectors longer than `threshold` scaled down to it (float32)."""
    norm: torch.Tensor = torch.linalg.vector_norm(x.float(), dim=-1, keepdim=True)
    return (x.float() * (threshold / (norm + 1e-6)).clamp(max=1.0)).to(x.dtype)


class ScaledClip(nn.Module):
    def __init__(self, num_heads: int, dim: int, threshold: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(num_heads, dim))
        self.threshold = threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return l2_clip(x.float() * self.scale.float(), self.threshold).to(x.dtype)


class BlockRead(nn.Module):
    """(blocks [T, B, hidden], x [T, hidden]) -> [T, Q, hidden]: Q learned queries over the
    RMS-normalised [blocks..., x] (values = the normalised states)."""

    def __init__(self, hidden: int, num_queries: int = 1) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(hidden) if num_queries == 1
                                  else torch.zeros(num_queries, hidden))

    def forward(self, blocks: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        states = unweighted_rms(torch.cat([blocks, x[:, None]], dim=1).float(), 1e-6)
        hidden = states.shape[-1]
        query = self.query.float().view(-1, hidden)  # [Q, hidden]
        scores = torch.einsum("qc,tbc->tqb", query, states) / math.sqrt(hidden)
        return torch.einsum("tqb,tbc->tqc", torch.softmax(scores, dim=-1), states)


class DynamicConv(nn.Module):
    """A causal conv over k (or v) [T, C] whose taps per KV head are static weights plus
    per-token ones projected from the layer's input: y = (conv(x) + x) / sqrt(2K + 1).
    Tap `lag` weights the input `lag` tokens back (static_weight[0]: the current one)."""

    def __init__(self, channels: int, input_size: int, num_heads: int, kernel: int) -> None:
        super().__init__()
        self.static_weight = nn.Parameter(torch.zeros(kernel, channels))
        self.weight_proj = nn.Linear(input_size, num_heads * kernel, bias=False)
        self.num_heads, self.kernel = num_heads, kernel

    def forward(self, x: torch.Tensor, taps_from: torch.Tensor, runs: list[StateRun],
                index: int) -> torch.Tensor:
        t, channels, k = x.shape[0], x.shape[1], self.kernel
        dynamic = self.weight_proj(taps_from).float().view(t, self.num_heads, 1, k)
        taps = self.static_weight.float().T.view(self.num_heads, -1, k) + dynamic
        y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        for run in runs:
            window = conv_window(x, run, index)  # [C, K - 1 + L]
            # [L, C, K] with [..., lag] the input lag tokens back.
            lags = window.unfold(-1, k, 1).flip(-1).transpose(0, 1)
            lags = lags.reshape(run.end - run.start, self.num_heads, -1, k)
            y[run.start:run.end] = (lags * taps[run.start:run.end]).sum(-1).view(-1, channels)
        return ((y + x.float()) / math.sqrt(2 * k + 1)).to(x.dtype)


class Inkling2Attention(nn.Module):
    def __init__(self, raw: Mapping[str, Any], layer: int, sliding: bool) -> None:
        super().__init__()
        hidden, prefix = int(raw["hidden_size"]), "swa_" if sliding else ""
        self.num_heads = h = int(raw[f"{prefix}num_attention_heads"])
        self.num_kv_heads = hk = int(raw[f"{prefix}num_key_value_heads"])
        self.head_dim = d = int(raw[f"{prefix}head_dim"])
        kernel, d_rel = int(raw["conv_kernel_size"]), int(raw["d_rel"])
        self.name, self.eps = f"model.layers.{layer}.self_attn", float(raw["rms_norm_eps"])
        self.q_proj = nn.Linear(hidden, h * d, bias=False)
        self.k_proj = nn.Linear(hidden, hk * d, bias=False)
        self.v_proj = nn.Linear(hidden, hk * d, bias=False)
        self.r_proj = nn.Linear(hidden, h * d_rel, bias=False)
        self.o_proj = nn.Linear(h * d, hidden, bias=False)
        self.gate_proj = nn.Linear(hidden, h * d, bias=False)
        self.sink_proj = nn.Linear(hidden, h, bias=False)
        self.k_sconv: nn.Module
        self.v_sconv: nn.Module
        if sliding:
            self.k_sconv = ResidualConv(hk * d, kernel, divisor=math.sqrt(kernel + 1))
            self.v_sconv = ResidualConv(hk * d, kernel, divisor=math.sqrt(kernel + 1))
        else:
            self.k_sconv = DynamicConv(hk * d, hidden, hk, kernel)
            self.v_sconv = DynamicConv(hk * d, hidden, hk, kernel)
        self.q_l2_clip = ScaledClip(h, d, float(raw["qk_l2_clip_threshold"]))
        self.rel_l2_clip = ScaledClip(h, d_rel, float(raw["rel_l2_clip_threshold"]))
        self.k_threshold = float(raw["qk_l2_clip_threshold"])
        window = int(raw["sliding_window"])
        self.rel_logits_proj = RelativeLogits(d_rel, window if sliding else int(raw["rel_extent"]))
        self.params = AttentionParams(scale=d ** -0.5, sliding_window=window if sliding else None)
        self.log_scaling = None if sliding else (float(raw["log_scaling_alpha"]),
                                                 float(raw["log_scaling_n_floor"]))

    def _kv(self, k_in: torch.Tensor, v_in: torch.Tensor, runs: list[StateRun]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(self.k_sconv, DynamicConv):
            return (self.k_sconv(self.k_proj(k_in), k_in, runs, K_CONV),
                    self.v_sconv(self.v_proj(v_in), v_in, runs, V_CONV))
        return (self.k_sconv(self.k_proj(k_in), runs, K_CONV),
                self.v_sconv(self.v_proj(v_in), runs, V_CONV))

    def forward(self, x: torch.Tensor, k_in: torch.Tensor, v_in: torch.Tensor,
                positions: torch.Tensor, ctx: ForwardContext, runs: list[StateRun]
                ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        k, v = self._kv(k_in, v_in, runs)
        q = self.q_l2_clip(self.q_proj(x).view(t, self.num_heads, d))
        k = l2_clip(k.view(t, self.num_kv_heads, d), self.k_threshold)
        v = unweighted_rms(v.view(t, self.num_kv_heads, d).float(), self.eps).to(v.dtype)
        r = self.rel_l2_clip(self.r_proj(x).view(t, self.num_heads, -1))
        if self.log_scaling is not None:
            tau = log_scale(positions, *self.log_scaling)  # float32, as the reference
            q, r = (q.float() * tau).to(q.dtype), (r.float() * tau).to(r.dtype)
        params = dataclasses.replace(self.params, query_bias=self.rel_logits_proj(r),
                                     token_sinks=self.sink_proj(x))
        out = ctx.attention(self.name, q, k, v, params).flatten(1)
        out = (out.float() * torch.sigmoid(self.gate_proj(x).float())).to(out.dtype)
        return self.o_proj(out)  # type: ignore[no-any-return]


def softcapped_swiglu(gate_cap: float, up_cap: float) -> Any:
    """The experts' GLU: the sigmoid sees the raw gate; softcaps bound the linear gate
    factor and up (float32)."""
    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        g, u = gate.float(), up.float()
        out = torch.tanh(g / gate_cap) * gate_cap * torch.sigmoid(g) * \
            (torch.tanh(u / up_cap) * up_cap)
        return out.to(gate.dtype)
    return glu


class Router(nn.Module):
    """The router's weight and its correction bias (checkpoints: `mlp.gate.bias`), a
    parameter so the loader finds it."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts),
                                                    requires_grad=False)


class Inkling2MoE(nn.Module):
    def __init__(self, raw: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, num_experts = int(raw["hidden_size"]), int(raw["n_routed_experts"])
        if raw["scoring_func"] != "sigmoid":
            raise NotImplementedError(f"inkling2: scoring_func {raw['scoring_func']!r} is not "
                                      f"supported; supported: sigmoid")
        self.gate = Router(hidden, num_experts)
        # Checkpoints keep gate and up interleaved along 2I (w13): read in place.
        self.experts = StackedExperts(
            num_experts, hidden, int(raw["moe_intermediate_size"]),
            softcapped_swiglu(float(raw["mlp_gate_softcap"]), float(raw["mlp_up_softcap"])),
            interleaved=True)
        self.top_k, self.route_scale = int(raw["num_experts_per_tok"]), float(raw["route_scale"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.linear(x.float(), self.gate.weight.float())  # float32 routing
        scores = logits.sigmoid()
        bias = self.gate.e_score_correction_bias
        ids = torch.topk(scores + bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.route_scale
        return self.experts(x, weights, ids)  # type: ignore[no-any-return]


class Inkling2Layer(nn.Module):
    """forward(stream [T, B + 1, hidden], positions, ctx) -> [T, B' + 1, hidden]."""

    def __init__(self, cfg: TextConfig, raw: Mapping[str, Any], layer: int, kind: str) -> None:
        super().__init__()
        hidden, eps, kernel = cfg.hidden_size, cfg.rms_norm_eps, int(raw["conv_kernel_size"])
        self.full = kind != SLIDING
        self.boundary = layer % int(raw["n_layers_per_attn_res_block"]) == 0
        self.attention_input = BlockRead(hidden, 3 if self.full else 1) if layer else None
        self.mlp_input = BlockRead(hidden)
        self.self_attn = Inkling2Attention(raw, layer, not self.full)
        self.mlp = Inkling2MoE(raw)
        if self.full:
            self.q_input_layernorm = RMSNorm(hidden, eps)
            self.k_input_layernorm = RMSNorm(hidden, eps)
            self.v_input_layernorm = RMSNorm(hidden, eps)
        else:
            self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.post_attention_convolution = ResidualConv(hidden, kernel,
                                                       divisor=math.sqrt(kernel + 1))
        self.post_mlp_convolution = ResidualConv(hidden, kernel, divisor=math.sqrt(kernel + 1))
        self.state_name = f"model.layers.{layer}.mamba"

    def _attention(self, blocks: torch.Tensor, h: torch.Tensor, positions: torch.Tensor,
                   ctx: ForwardContext, runs: list[StateRun]) -> torch.Tensor:
        reads = [h] * 3 if self.attention_input is None else \
            [x.to(h.dtype) for x in self.attention_input(blocks, h).unbind(1)]
        if self.full:
            q_in, k_in, v_in = (self.q_input_layernorm(reads[0]), self.k_input_layernorm(
                reads[1]), self.v_input_layernorm(reads[2]))
        else:
            q_in = k_in = v_in = self.input_layernorm(reads[0])
        return self.self_attn(q_in, k_in, v_in, positions, ctx, runs)  # type: ignore[no-any-return]

    def forward(self, stream: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        blocks, h = stream[:, :-1], stream[:, -1]
        runs = ready_states(*ctx.state(self.state_name))
        a = self.post_attention_convolution(self._attention(blocks, h, positions, ctx, runs),
                                            runs, ATTN_CONV).float()
        if self.boundary:
            blocks = torch.cat([blocks, h[:, None]], dim=1)
            residual = a
        else:
            residual = h.float() + a
        x = self.mlp_input(blocks, residual)[:, 0]
        m = self.mlp(self.post_attention_layernorm(x).to(h.dtype))
        out = (residual + self.post_mlp_convolution(m, runs, MLP_CONV)).to(h.dtype)
        return torch.cat([blocks, out[:, None]], dim=1)


def _renamed(weights: Iterable[tuple[str, torch.Tensor]], vocab: int
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint names -> the module names here (the head cut to its `vocab` real rows)."""
    rules = [(re.compile(a), b) for a, b in _CHECKPOINT_NAMES]
    offset = re.compile(r"attn_res\.attn_queries\.(\d+)$")
    for name, tensor in weights:
        if name == "model.llm.unembed.weight":
            yield "lm_head.weight", tensor[:vocab]
            continue
        for pattern, repl in rules:
            name = pattern.sub(repl, name)
        # attn_queries[i] belongs to layer i + 1 (layer 0 reads h as it is).
        name = offset.sub(lambda m: f"layers.{int(m.group(1)) + 1}.attention_input.query",
                          name)
        yield name, tensor


_CHECKPOINT_NAMES = [
    (r"^model\.llm\.", "model."), (r"^model\.embed\.", "model.embed_tokens."),
    (r"^model\.embed_norm\.", "model.embed_tokens.embed_norm."),
    (r"mlp\.experts\.w13_weight$", "mlp.experts.gate_up_proj"),
    (r"mlp\.experts\.w2_weight$", "mlp.experts.down_proj"),
    (r"mlp\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
    (r"\.attn\.wq_du\.", ".self_attn.q_proj."), (r"\.attn\.wk_dv\.", ".self_attn.k_proj."),
    (r"\.attn\.wv_dv\.", ".self_attn.v_proj."), (r"\.attn\.wr_du\.", ".self_attn.r_proj."),
    (r"\.attn\.wo_ud\.", ".self_attn.o_proj."), (r"\.attn\.gate_attn\.", ".self_attn.gate_proj."),
    (r"\.attn\.attn_sink_proj\.", ".self_attn.sink_proj."), (r"\.attn\.", ".self_attn."),
    (r"\.attn_sconv\.", ".post_attention_convolution."),
    (r"\.mlp_sconv\.", ".post_mlp_convolution."),
    (r"(convolution|sconv)\.weight$", r"\1.conv1d.weight"),
    (r"sconv\.static_w$", "sconv.static_weight"),
    (r"sconv\.weight_proj$", "sconv.weight_proj.weight"),
    (r"\.mlp_norm\.", ".post_attention_layernorm."), (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.(q|k|v)_input_norm\.", r".\1_input_layernorm."),
    (r"attn_res\.mlp_queries\.(\d+)$", r"layers.\1.mlp_input.query"),
    (r"attn_res\.output_query$", "final_input.query"),
]


class Inkling2ForCausalLM(CausalLM):
    refused_cache_dtypes = {"q4": "Inkling 2's relative bias and sinks per query read K/V "
                                  "pages in full precision or int8"}

    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config)
        raw = {**DEFAULTS, **{k: v for k, v in with_family_defaults(cfg.raw).items()
                              if v is not None}}
        cfg = dataclasses.replace(cfg, final_logit_softcap=float(raw["final_logit_softcapping"]))
        kinds = [parts[0] for parts in cfg.layer_kinds]
        super().__init__(cfg, (Inkling2Layer(cfg, raw, i, k) for i, k in enumerate(kinds)))
        self.model.embed_tokens = NormedEmbedding(cfg.vocab_size, cfg.hidden_size,
                                                  cfg.rms_norm_eps)
        self.model.final_input = BlockRead(cfg.hidden_size)
        # Logits past unpadded_vocab_size are dropped: the head keeps only those rows.
        self.vocab = int(raw.get("unpadded_vocab_size") or cfg.vocab_size)
        self.lm_head = nn.Linear(cfg.hidden_size, self.vocab, bias=False)

    @property
    def logits_size(self) -> int:
        return self.vocab  # the head's rows: ids past unpadded_vocab_size are never sampled

    def enter_layers(self, h: torch.Tensor) -> torch.Tensor:
        return h[:, None]  # no block summaries yet

    def leave_layers(self, h: torch.Tensor) -> torch.Tensor:
        final_input = cast(BlockRead, self.model.final_input)
        read: torch.Tensor = final_input(h[:, :-1], h[:, -1])
        return read[:, 0].to(h.dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_renamed(weights, self.vocab))
