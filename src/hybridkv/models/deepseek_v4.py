"""DeepSeek-V4 (transformers' DeepseekV4ForCausalLM): every layer attends to a sliding window
of K=V rows (one KV head, `head_dim` wide, the attention's group of `sliding_window` rows),
and "compressed_sparse_attention" (CSA) / "heavily_compressed_attention" (HCA) layers also to
entries that each compress a window of tokens (layers/window_compressor.py): CSA's top
`index_topk` of its lightning indexer's choice, HCA's all; a sink logit per head sits beside
them (worker/attention/compressed.py). Around each sublayer, manifold-constrained
hyper-connections over `hc_mult` residual streams (layers/manifold_hyper_connection.py).

    q   = RoPE(rms(wq_b(q_norm(wq_a(x)))))  per head, unscaled rms; RoPE on the last dims
    kv  = RoPE(norm(wkv(x)))                 the window's row (K = V)
    o   = RoPE^-1(attention(q, rows, entries, sink))   the rows' rotation undone at q's
    out = wo_b(grouped wo_a(o))              wo_a block-diagonal over `o_groups` head groups
    indexer score(t, w) = sum_h weights_proj(x)[t, h] relu(q_i[t, h] . key_w) / sqrt(Hi Di)

RoPE rotates adjacent pairs of each head's last `qk_rope_head_dim` dims, by the "main"
parameters on sliding layers and the "compress" ones (their own theta, YaRN) on CSA / HCA
layers, their compressors and indexer (layers/pair_rope.py). The MoE routes by
sqrt(softplus) scores, top k with a correction bias, or (`hash_moe` layers) by a fixed
token -> experts table; experts and the shared expert clamp their SwiGLU at `swiglu_limit`
(layers/clamped_moe.py).

Checkpoint names are DeepSeek's (`attn.wq_a`, `ffn.experts.0.w1`, `hc_attn_fn`, ...), as
transformers saves them. Refused at load: FP8 checkpoints, quantized KV pages, a router
scoring other than sqrtsoftplus / sigmoid, an indexer narrower than the RoPE dims."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import deepseek_v4_layer_types, deepseek_v4_rates
from hybridkv.models.layers.clamped_moe import Router, V4MoE
from hybridkv.models.layers.manifold_hyper_connection import (
    HyperHead,
    hyper_merge,
    hyper_weights,
    scale_free_norm,
)
from hybridkv.models.layers.pair_rope import PairRope, rope_parameters
from hybridkv.models.layers.residual_conv import StateRun, ready_states
from hybridkv.models.layers.window_compressor import V4Norm, WindowCompressor
from hybridkv.models.text_config import TextConfig
from hybridkv.models.weights import renamed
from hybridkv.worker.attention.compressed import (
    compressed_attention,
    indexer_top_k,
    read_entries,
    sliding_rows,
    write_entries,
)
from hybridkv.worker.attention.sparse_mla import write_rows
from hybridkv.worker.forward_context import ForwardContext

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
QUANTIZED_PAGES = ("DeepSeek-V4's window rows and compressed entries are read as K = V rows "
                   "in the model's dtype; quantized pages are not read here; use "
                   "kv_cache_dtype auto")


class Indexer(nn.Module):
    """CSA's lightning indexer (checkpoint `attn.indexer`): its own compressor's keys, one
    per window, and per query a score for each."""

    def __init__(self, cfg: Mapping[str, Any], rate: int, eps: float) -> None:
        super().__init__()
        hidden, q_rank = int(cfg["hidden_size"]), int(cfg["q_lora_rank"])
        self.num_heads, self.head_dim = int(cfg["index_n_heads"]), int(cfg["index_head_dim"])
        self.top_k = int(cfg["index_topk"])
        self.wq_b = nn.Linear(q_rank, self.num_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(hidden, self.num_heads, bias=False)
        # Its state tensors follow the attention compressor's four.
        self.compressor = WindowCompressor(hidden, self.head_dim, rate, True, eps, states=4)

    def scores(self, x: torch.Tensor, q_resid: torch.Tensor, keys: torch.Tensor,
               rope: PairRope, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[n, E]: the request's queries (x, q_resid [n, .]) against its keys [E, Di]."""
        q = rope.rotate(self.wq_b(q_resid).unflatten(-1, (self.num_heads, self.head_dim)),
                        cos, sin)
        relu = torch.relu(torch.matmul(q.float(), keys.float().T)) * self.head_dim ** -0.5
        weights = self.weights_proj(x).float() * self.num_heads ** -0.5  # [n, Hi]
        return (relu * weights.unsqueeze(-1)).sum(dim=1)  # type: ignore[no-any-return]


class V4Attention(nn.Module):
    """forward(x [T, hidden], positions [T], ctx) -> [T, hidden] (checkpoint `attn`)."""

    def __init__(self, cfg: Mapping[str, Any], layer: int, layer_type: str,
                 ropes: Mapping[str, PairRope]) -> None:
        super().__init__()
        self.name = f"model.layers.{layer}.self_attn"
        hidden, q_rank = int(cfg["hidden_size"]), int(cfg["q_lora_rank"])
        self.num_heads, self.head_dim = int(cfg["num_attention_heads"]), int(cfg["head_dim"])
        self.groups, o_rank = int(cfg["o_groups"]), int(cfg["o_lora_rank"])
        self.window = int(cfg["sliding_window"])
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        heads_width = self.num_heads * self.head_dim
        self.wq_a = nn.Linear(hidden, q_rank, bias=False)
        self.q_norm = V4Norm(q_rank, self.eps)
        self.wq_b = nn.Linear(q_rank, heads_width, bias=False)
        self.wkv = nn.Linear(hidden, self.head_dim, bias=False)
        self.norm = V4Norm(self.head_dim, self.eps)
        self.wo_a = nn.Linear(heads_width // self.groups, self.groups * o_rank, bias=False)
        self.wo_b = nn.Linear(self.groups * o_rank, hidden, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.num_heads))
        self.layer_type = layer_type
        self.rope_label = "main" if layer_type == "sliding_attention" else "compress"
        self.ropes = ropes  # shared, not parameters
        self.rate = 0
        self.compressor: WindowCompressor | None = None
        self.indexer: Indexer | None = None
        if layer_type in (CSA, HCA):
            self.rate = deepseek_v4_rates(cfg)[layer_type]
            self.compressor = WindowCompressor(hidden, self.head_dim, self.rate,
                                               layer_type == CSA, self.eps, states=0)
        if layer_type == CSA:
            self.indexer = Indexer(cfg, self.rate, self.eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        rope = self.ropes[self.rope_label]
        cos, sin = rope.cos_sin(positions, x.dtype)
        q_resid = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_resid).unflatten(-1, (self.num_heads, self.head_dim))
        q = rope.rotate(scale_free_norm(q, self.eps), cos, sin)
        kv = rope.rotate(self.norm(self.wkv(x))[:, None], cos, sin)[:, 0]
        meta = ctx.metadata[ctx.layer_group[self.name]]
        rows_view = ctx.kv_caches[self.name]
        write_rows(rows_view, meta, kv)
        runs = self._state_runs(ctx)
        out = torch.empty_like(q)
        loc = meta.query_start_loc
        for r, seq_len in enumerate(meta.seq_lens):
            a, b = loc[r], loc[r + 1]
            if a == b:
                continue
            start = seq_len - (b - a)
            entries, mask = self._entries(x[a:b], q_resid[a:b], cos[a:b], sin[a:b], start,
                                          seq_len, r, runs, ctx)
            lo = max(0, start - self.window + 1)
            rows = sliding_rows(rows_view, meta, r, lo, seq_len)
            out[a:b] = compressed_attention(
                q[a:b], rows, torch.arange(lo, seq_len, device=x.device), entries, mask,
                positions[a:b], self.window, self.attn_sink, self.head_dim ** -0.5)
        out = rope.rotate(out, cos, -sin)  # the rows' rotation undone at the query
        grouped = out.reshape(x.shape[0], self.groups, -1)
        weight = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1])
        return self.wo_b(torch.einsum("tgi,goi->tgo", grouped, weight).flatten(1))  # type: ignore[no-any-return]

    def _state_runs(self, ctx: ForwardContext) -> dict[int, StateRun]:
        """Per request (batch row) with tokens, its compressor state made ready."""
        if self.compressor is None:
            return {}
        meta, states = ctx.state(self.name + ".compressor_state")
        loc = meta.query_start_loc
        rows = [r for r in range(len(loc) - 1) if loc[r + 1] > loc[r]]
        return dict(zip(rows, ready_states(meta, states), strict=True))

    def _entries(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, start: int, seq_len: int, r: int,
                 runs: dict[int, StateRun], ctx: ForwardContext
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """One request's entries after this step's are written, [E, D], and which each of
        its queries reads, [n, E]."""
        n = x.shape[0]
        if self.compressor is None:
            return x.new_zeros(0, self.head_dim), torch.zeros(n, 0, dtype=torch.bool,
                                                               device=x.device)
        rope, rate, run = self.ropes["compress"], self.rate, runs[r]
        name = self.name + ".compressor"
        meta = ctx.metadata[ctx.layer_group[name]]
        first, new = self.compressor(x, run, start, rope.at)
        write_entries(ctx.kv_caches[name], meta, r, first, new, rate)
        count = seq_len // rate
        entries = read_entries(ctx.kv_caches[name], meta, r, count, rate)
        q_pos = start + torch.arange(n, device=x.device)
        if self.indexer is None:  # HCA: every closed window
            closed = (q_pos + 1) // rate
            return entries, torch.arange(count, device=x.device)[None, :] < closed[:, None]
        key_name = self.name + ".indexer"
        key_meta = ctx.metadata[ctx.layer_group[key_name]]
        first, new = self.indexer.compressor(x, run, start, rope.at)
        write_entries(ctx.kv_caches[key_name], key_meta, r, first, new, rate)
        keys = read_entries(ctx.kv_caches[key_name], key_meta, r, count, rate)
        scores = self.indexer.scores(x, q_resid, keys, rope, cos, sin)
        prompt = key_meta.prompt_lens[r] if key_meta.prompt_lens is not None else seq_len
        return entries, indexer_top_k(scores, start, prompt, rate, self.indexer.top_k)


class V4Layer(nn.Module):
    """h [T, hc_mult, hidden] -> the same: attention, then the MoE, each inside its
    hyper-connection (`hc_attn_*`, `hc_ffn_*`)."""

    def __init__(self, cfg: Mapping[str, Any], layer: int, layer_type: str, mlp_type: str,
                 ropes: Mapping[str, PairRope]) -> None:
        super().__init__()
        hidden, n = int(cfg["hidden_size"]), int(cfg.get("hc_mult", 4))
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.hc_eps, self.iters = float(cfg.get("hc_eps", 1e-6)), int(
            cfg.get("hc_sinkhorn_iters", 20))
        self.attn = V4Attention(cfg, layer, layer_type, ropes)
        self.ffn = V4MoE(cfg, mlp_type == "hash_moe")
        self.attn_norm = V4Norm(hidden, self.eps)
        self.ffn_norm = V4Norm(hidden, self.eps)
        width = (2 + n) * n
        for part in ("attn", "ffn"):
            self.register_parameter(f"hc_{part}_fn", nn.Parameter(torch.zeros(width,
                                                                              n * hidden)))
            self.register_parameter(f"hc_{part}_base", nn.Parameter(torch.zeros(width)))
            self.register_parameter(f"hc_{part}_scale", nn.Parameter(torch.ones(3)))

    def _weights(self, h: torch.Tensor, part: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return hyper_weights(h, getattr(self, f"hc_{part}_fn"), getattr(self, f"hc_{part}_base"),
                             getattr(self, f"hc_{part}_scale"), iters=self.iters,
                             eps=self.hc_eps, norm_eps=self.eps)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        post, comb, x = self._weights(h, "attn")
        h = hyper_merge(h, self.attn(self.attn_norm(x), positions, ctx), post, comb)
        post, comb, x = self._weights(h, "ffn")
        return hyper_merge(h, self.ffn(self.ffn_norm(x), ids), post, comb)


def _kept_in_float32(module: nn.Module, name: str) -> bool:
    return (isinstance(module, (V4Norm, HyperHead)) or name.startswith("hc_")
            or name in ("attn_sink", "ape") or (isinstance(module, Router) and name == "bias"))


def _refuse(raw: Mapping[str, Any]) -> None:
    quant = raw.get("quantization_config") or {}
    if quant:
        raise NotImplementedError(f"deepseek_v4: quantized checkpoints "
                                  f"({quant.get('quant_method', quant)}) are not supported; "
                                  f"accepted: unquantized (bf16 / float32) weights")
    scoring = raw.get("scoring_func") or "sqrtsoftplus"
    if scoring not in ("sqrtsoftplus", "sigmoid"):
        raise NotImplementedError(f"deepseek_v4: scoring_func {scoring!r} is not supported; "
                                  f"accepted: sqrtsoftplus, sigmoid")
    rope_dim = int(int(raw["head_dim"]) * float(raw.get("partial_rotary_factor") or (
        int(raw.get("qk_rope_head_dim") or 64) / int(raw["head_dim"]))))
    if CSA in deepseek_v4_layer_types(raw) and int(raw["index_head_dim"]) < rope_dim:
        raise ValueError(f"deepseek_v4: index_head_dim {raw['index_head_dim']} is narrower "
                         f"than the {rope_dim} RoPE dims its queries and keys rotate")


class DeepseekV4ForCausalLM(CausalLM):
    unused_prefixes = ("mtp.", "model.mtp.")  # the multi-token-prediction layer
    refused_cache_dtypes = {d: QUANTIZED_PAGES for d in ("int8", "q4", "fp8")}
    integer_weights = (".gate.tid2eid",)  # hash layers' token -> experts tables

    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config, eps=1e-6)
        raw = cfg.raw
        _refuse(raw)
        head_dim = int(raw["head_dim"])
        factor = raw.get("partial_rotary_factor") or int(raw.get("qk_rope_head_dim") or 64) \
            / head_dim
        rope_dim = int(head_dim * float(factor))
        max_positions = int(raw.get("max_position_embeddings") or 1 << 20)
        ropes = {label: PairRope(rope_dim, params, max_positions)
                 for label, params in rope_parameters(raw).items()}
        types = deepseek_v4_layer_types(raw)
        mlp_types = list(raw.get("mlp_layer_types") or (
            ["hash_moe"] * int(raw.get("num_hash_layers", 3)) + ["moe"] * len(types)))
        layers = [V4Layer(raw, i, t, mlp_types[i], ropes) for i, t in enumerate(types)]
        super().__init__(cfg, layers)
        self.model.norm = V4Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_mult = int(raw.get("hc_mult", 4))
        self.model.hc_head = HyperHead(cfg.hidden_size, self.hc_mult,
                                       float(raw.get("hc_eps", 1e-6)), cfg.rms_norm_eps)
        # One module per RoPE label, shared by the layers (inv_freq buffers, no weights).
        self.ropes = nn.ModuleDict(ropes)

    def _apply(self, fn: Any, recurse: bool = True) -> DeepseekV4ForCausalLM:
        # transformers keeps the norms, hyper-connection weights, sinks, position biases and
        # the routers' correction biases in float32 whatever the model's dtype
        # (`_keep_in_fp32_modules_strict`): so does this model, through every .to().
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        for module in self.modules():
            for name, param in module.named_parameters(recurse=False):
                if param.is_floating_point() and param.dtype != torch.float32 and \
                        _kept_in_float32(module, name):
                    param.data = param.data.float()
        return self

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        h = self.embed(input_ids)
        streams = h[:, None, :].expand(-1, self.hc_mult, -1).contiguous()
        for layer in self.model.layers:  # type: ignore[union-attr]
            streams = layer(streams, positions, input_ids, ctx)
        head: HyperHead = self.model.hc_head  # type: ignore[assignment]
        return self.model.norm(head(streams))  # type: ignore[no-any-return,operator]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # transformers saves `head.weight`; DeepSeek's release also drops the `model.`
        # prefix and spells the embedding and head mixer its own way.
        super().load_weights(renamed(weights, [
            (r"^head\.", "lm_head."), (r"^embed\.", "model.embed_tokens."),
            (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
            (r"^(layers|norm)\.", r"model.\1.")]))
