"""Multi-head latent attention (DeepSeek-V2's MLA) as Kimi Linear and Ling 3.0 (Bailing
hybrid) write it. Keys and values come from one latent per token, which is all the KV cache
keeps (worker/attention/mla.py):

    q             = q_proj(h)  or  q_b_proj(norm(q_a_proj(h)))         [T, H, nope + rope]
    c_kv | k_pe   = kv_a_proj_with_mqa(h);  c_kv = kv_a_layernorm(c_kv)  [T, rank], [T, rope]
    RoPE on q's last `rope` dims and k_pe (DeepSeek's interleaved pairs), or none (Kimi)
    latent        = c_kv | k_pe    -> the cache
    k_nope | v    = kv_b_proj(c_kv) per head;  k = k_nope | k_pe (shared by the heads)
    out           = o_proj(attention(q, k, v) [x sigmoid(g_proj(h)) per head])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.layers.norms import RMSNorm
from hybridkv.models.layers.rotary import Rotary, apply_rope
from hybridkv.worker.attention.mla import MLAParams
from hybridkv.worker.forward_context import ForwardContext

# The latent and query norms' eps in both references (they do not read rms_norm_eps).
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """forward(h [T, hidden], positions [T], ctx) -> [T, hidden]. `rotary`: RoPE over
    `qk_rope_head_dim` in DeepSeek's interleaved-pair layout, or None (NoPE, Kimi Linear);
    `output_gate`: a sigmoid gate per head (`g_proj`, Ling 3.0); `out_name`: the output
    projection's checkpoint name (`o_proj`, or Ling's `dense`)."""

    def __init__(self, cfg: Mapping[str, Any], layer: int, *, scale: float,
                 rotary: Rotary | None, output_gate: bool = False,
                 out_name: str = "o_proj") -> None:
        super().__init__()
        self.name = f"model.layers.{layer}.self_attn"
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        bias = bool(cfg.get("attention_bias", False))
        self.rank, self.rope_dim = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
        nope, v_dim = int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"])
        self.params = MLAParams(scale=scale, num_heads=heads, kv_lora_rank=self.rank,
                                qk_nope_head_dim=nope, v_head_dim=v_dim)
        q_width = heads * (nope + self.rope_dim)
        q_rank = cfg.get("q_lora_rank")
        if q_rank:
            self.q_a_proj = nn.Linear(hidden, int(q_rank), bias=bias)
            self.q_a_layernorm = RMSNorm(int(q_rank), LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(int(q_rank), q_width, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, heads * (nope + v_dim), bias=False)
        self.out_name = out_name
        self.add_module(out_name, nn.Linear(heads * v_dim, hidden, bias=bias))
        self.g_proj = nn.Linear(hidden, heads, bias=False) if output_gate else None
        self.rotary = rotary

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            q = self.q_proj(h)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))
        q = q.unflatten(-1, (self.params.num_heads, -1))  # [T, H, nope + rope]
        c_kv, k_pe = self.kv_a_proj_with_mqa(h).split([self.rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        if self.rotary is not None:
            cos, sin = self.rotary.cos_sin(positions, ctx)
            nope = self.params.qk_nope_head_dim
            q = torch.cat([q[..., :nope], rope_interleaved(q[..., nope:], cos, sin)], dim=-1)
            k_pe = rope_interleaved(k_pe[:, None], cos, sin)[:, 0]
        latent = torch.cat([c_kv, k_pe], dim=-1)  # [T, rank + rope]
        out = ctx.mla_attention(self.name, q, latent, self.kv_b_proj.weight, self.params)
        if self.g_proj is not None:
            out = out * torch.sigmoid(self.g_proj(h).float()).to(h.dtype)[..., None]
        return getattr(self, self.out_name)(out.flatten(1))  # type: ignore[no-any-return]


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's RoPE: pairs (x[2i], x[2i+1]) rotated by frequency i, written out as
    [rotated evens | rotated odds] (the layout its checkpoints expect after RoPE). That is
    the half-split rotation of the de-interleaved vector. x [T, H, D]; cos/sin [T, 1, D]."""
    return apply_rope(torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1), cos, sin)
