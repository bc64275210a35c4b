"""Self-attention as the families here write it: q/k/v projections, optional per-head norms,
RoPE (whole or partial head), `ctx.attention` over the layer's KV cache, o_proj.

Each tensor goes through its steps in this order (a step is skipped when its option is off):
    (q_proj, k_proj, v_proj: one GEMM once `fuse_linears` ran)
    q: q_proj -> [split off the output gate] -> q_norm -> RoPE
    k: k_proj -> [x key_multiplier] -> k_norm -> RoPE
    v: v_proj (or the raw keys, `values_are_keys`) -> [scale-free RMS norm]
    out: attention -> [x sigmoid(output gate)] -> o_proj
A layer that reads another layer's KV cache (KV sharing) has no k/v projections or k norm:
it computes queries only.

Values-equal-keys layers keep K-only pages: they write the raw keys (k_proj's output) and hand
the backend `derive_kv`, which turns a context's raw keys into K (k norm, RoPE at the context
positions) and V (its norm) exactly as a K/V page would hold them. A layer sharing such a
layer's cache derives with that layer's norms and RoPE (`read_keys_of`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import nn

from hybridkv.models.layers.norms import RMSNorm, rms_normalize
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.text_config import TextConfig
from hybridkv.worker import cpu_ops
from hybridkv.worker.attention.backend import AttentionParams
from hybridkv.worker.forward_context import ForwardContext
from hybridkv.worker.linear.layers import Linear


@dataclass(frozen=True, kw_only=True)
class AttentionShape:
    """The options of one attention layer besides its RoPE and kernel parameters."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool = False
    o_bias: bool | None = None  # o_proj's bias when it differs from q/k/v's (Qwen2: none)
    qk_norm: bool = False
    norm_offset: float = 0.0  # (1 + w) norms: Gemma, Qwen3-Next
    eps: float = 1e-6
    value_norm: bool = False  # Gemma 3n/4
    values_are_keys: bool = False  # Gemma 4 full layers: v = k before its norm and RoPE
    output_gate: bool = False  # Qwen3-Next: q_proj also yields a sigmoid gate per head
    key_multiplier: float = 1.0  # Falcon-H1 µP
    sinks: bool = False  # gpt-oss: learned per-head logits in the softmax, with no value

    @classmethod
    def from_config(cls, cfg: TextConfig, **options: Any) -> AttentionShape:
        """The config's sizes, bias and eps; `options` override them or set the rest."""
        return cls(**{**dict(hidden_size=cfg.hidden_size, num_heads=cfg.num_heads,
                             num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                             bias=cfg.attention_bias, eps=cfg.rms_norm_eps), **options})


class Attention(nn.Module):
    """forward(h [T, hidden], positions [T], ctx) -> [T, hidden]."""

    def __init__(self, layer: int, shape: AttentionShape, params: AttentionParams, *,
                 rotary: Rotary | None, reads_shared_kv: bool = False) -> None:
        super().__init__()
        s = shape
        self.name = f"model.layers.{layer}.self_attn"
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, \
            s.head_dim
        self.shape, self.params, self.rotary = s, params, rotary
        self.reads_shared_kv = reads_shared_kv
        q_width = (2 if s.output_gate else 1) * s.num_heads * s.head_dim
        kv_width = s.num_kv_heads * s.head_dim
        self.q_proj = nn.Linear(s.hidden_size, q_width, bias=s.bias)
        self.k_proj = None if reads_shared_kv else nn.Linear(s.hidden_size, kv_width,
                                                              bias=s.bias)
        self.v_proj = None if reads_shared_kv or s.values_are_keys else nn.Linear(
            s.hidden_size, kv_width, bias=s.bias)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size,
                                bias=s.bias if s.o_bias is None else s.o_bias)
        self.q_norm = RMSNorm(s.head_dim, s.eps, s.norm_offset) if s.qk_norm else None
        self.k_norm = RMSNorm(s.head_dim, s.eps, s.norm_offset) if (
            s.qk_norm and not reads_shared_kv) else None
        self.sinks = nn.Parameter(torch.zeros(s.num_heads)) if s.sinks else None
        self.has_k, self.has_v = self.k_proj is not None, self.v_proj is not None
        self.native_ops = False  # the output gate in C (worker/cpu_ops.py)
        self.qkv: Linear | None = None  # set by fuse_linears
        # K-only pages: the layer whose norms and RoPE turn the raw keys into K and V (this
        # one, or for a KV-sharing layer its target's: see `read_keys_of`).
        self.keys_only = s.values_are_keys
        self.kv_deriver: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = (
            self.derive_kv if s.values_are_keys and not reads_shared_kv else None)

    def read_keys_of(self, target: Attention) -> None:
        """KV sharing: this layer reads `target`'s cache; K-only pages are read as it does."""
        self.kv_deriver = target.kv_deriver

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        return self.attend(*self.rotated_qkv(h, positions, ctx), ctx)

    def rotated_qkv(self, h: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                               torch.Tensor | None]:
        """(q, k, v, gate) with RoPE applied: what variants change before `attend`."""
        q_out, k_out, v_out = self.project(h)
        q, gate = self.queries(q_out)
        if self.keys_only:  # K-only pages take the raw keys; K and V come at each read
            k = None if k_out is None else k_out.unflatten(-1, (self.num_kv_heads, -1))
            v = None
        else:
            k, v = self.keys_values(k_out, v_out)
        if self.rotary is not None:
            cos, sin = self.rotary.cos_sin(positions, ctx)
            q = self.rotary.rotate(q, cos, sin)
            if k is not None and not self.keys_only:
                k = self.rotary.rotate(k, cos, sin)
        return q, k, v, gate

    def project(self, h: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The q, k and v projections of h, [T, width] each (k, v None where the layer has no
        such projection): one GEMM once `fuse_linears` has run."""
        if self.qkv is not None:
            outs = iter(self.qkv.split(h))
            return next(outs), next(outs) if self.has_k else None, \
                next(outs) if self.has_v else None
        return (self.q_proj(h), self.k_proj(h) if self.k_proj is not None else None,
                self.v_proj(h) if self.v_proj is not None else None)

    def fuse_linears(self, kernel: str) -> None:
        """q/k/v as one GEMM and o_proj on `kernel` (see worker/linear/layers.py)."""
        projections = [p for p in (self.q_proj, self.k_proj, self.v_proj) if p is not None]
        self.qkv = Linear(projections, kernel)
        self.q_proj = self.k_proj = self.v_proj = None
        self.o_proj = Linear([self.o_proj], kernel)

    def queries(self, q_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q_proj's output -> (q [T, Hq, D] before RoPE, output gate [T, Hq, D] or None)."""
        q = q_out.unflatten(-1, (self.num_heads, -1))
        gate = None
        if self.shape.output_gate:
            q, gate = q.chunk(2, -1)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return q, gate

    def keys_values(self, k_out: torch.Tensor | None, v_out: torch.Tensor | None
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """k_proj's and v_proj's outputs -> (k before RoPE, v), each [T, Hk, D]; (None, None)
        for a KV-sharing layer."""
        if k_out is None:
            return None, None
        raw_k = k_out.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = raw_k if v_out is None else v_out.unflatten(-1, (self.num_kv_heads, self.head_dim))
        return self.normed_keys_values(raw_k, v)

    def normed_keys_values(self, raw_k: torch.Tensor, v: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw keys and values [..., Hk, D] -> (k before RoPE, v) after their norms."""
        k = raw_k
        if self.shape.key_multiplier != 1.0:
            k = k * self.shape.key_multiplier
        if self.k_norm is not None:
            k = self.k_norm(k)
        if self.shape.value_norm:
            v = rms_normalize(v, self.shape.eps)
        return k, v

    def derive_kv(self, raw: torch.Tensor, positions: torch.Tensor, *, ctx: ForwardContext
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """K-only pages: a context's raw keys [P, L, Hk, D] at positions [L] -> (K, V), each
        [P, L, Hk, D], equal to what this layer would have written to K/V pages."""
        k, v = self.normed_keys_values(raw, raw)
        if self.rotary is not None:
            # The context's positions are 0..L-1: one cos/sin per length and RoPE per step.
            r = self.rotary
            cos, sin = ctx.rope_cos_sin(positions, ("context", raw.shape[1], r.key),
                                        r.inv_freq, r.scaling, step_positions=False)
            k = r.rotate(k, cos, sin)
        return k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
               gate: torch.Tensor | None, ctx: ForwardContext) -> torch.Tensor:
        out = ctx.attention(self.name, q, k, v, self.attention_params(ctx))
        return self.output(out, gate)

    def attention_params(self, ctx: ForwardContext) -> AttentionParams:
        params = self.params if self.sinks is None else replace(self.params, sinks=self.sinks)
        if self.kv_deriver is not None:
            params = replace(params, derive_kv=partial(self.kv_deriver, ctx=ctx))
        return params

    def output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The attention's output [T, Hq, D] -> [T, hidden]."""
        out = out.flatten(1)
        if gate is not None:
            if self.native_ops and out.is_contiguous() and cpu_ops.takes(out) and \
                    cpu_ops.takes(gate) and gate.dim() == 3:
                # The C call models/native_decode.py makes (the same bytes there).
                out = cpu_ops.sigmoid_gate(out, gate)
            else:
                out = out * torch.sigmoid(gate.flatten(1))
        return self.o_proj(out)  # type: ignore[no-any-return]

    @property
    def cuts_rows(self) -> bool:
        """Whether `forward_rows` computes what `forward` does (variants that change
        `forward` itself do not say so)."""
        return type(self).forward is Attention.forward and type(self).attend is Attention.attend

    def forward_rows(self, h: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                     rows: torch.Tensor, rows_ctx: ForwardContext) -> torch.Tensor | None:
        """`forward(h, positions, ctx)[rows]`, for the rows `rows_ctx` describes: every
        token's K/V is written, and attention and o_proj run for those rows alone (None
        when there are none)."""
        q, k, v, gate = self.rotated_qkv(h, positions, ctx)
        params = self.attention_params(ctx)
        ctx.write_kv(self.name, k, v, params)
        if rows.numel() == 0:
            return None
        out = rows_ctx.attention(self.name, q[rows], None, None, params)
        return self.output(out, None if gate is None else gate[rows])
