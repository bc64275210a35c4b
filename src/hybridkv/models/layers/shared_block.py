"""Zamba's shared transformer block: one attention + MLP block whose weights serve several
"hybrid" layers of a Mamba backbone, each invocation with a KV cache of its own.

    hybrid layer i (invocation j):
        t = linear(shared(h, embedding))              # shared: [h | embedding], 2 x hidden
        h = h + mamba(input_layernorm(h + t))         # the residual skips t
    shared(h, e):
        x = input_layernorm([h | e]); x = attention(x)   (-> hidden; no residual)
        return mlp(pre_ff_layernorm(x))                   (no residual)

Zamba2 adds low-rank adapters per invocation: on the MLP's gate/up projection always, on
q, k and v with `use_shared_attention_adapter`. A block's adapter lists are indexed by
invocation and hold adapters only for the invocations that use that block (the others are
placeholders without weights, as in the checkpoints).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.layers.activations import activation
from hybridkv.models.layers.norms import RMSNorm
from hybridkv.models.layers.rotary import Rotary
from hybridkv.worker.attention.backend import AttentionParams
from hybridkv.worker.forward_context import ForwardContext


def adapter_list(invocations: list[bool], dim_in: int, rank: int, dim_out: int
                 ) -> nn.ModuleList:
    """Per invocation: down/up projections through `rank` where `invocations[j]` (this
    block serves invocation j), else a placeholder that is never called."""
    return nn.ModuleList(
        nn.Sequential(nn.Linear(dim_in, rank, bias=False), nn.Linear(rank, dim_out, bias=False))
        if used else nn.Identity() for used in invocations)


class SharedAttention(nn.Module):
    """Causal attention over x [T, 2 x hidden]; the caller names the KV cache (the hybrid
    layer's) and the invocation (its adapters)."""

    linear_q_adapter_list: nn.ModuleList  # present with adapters only
    linear_k_adapter_list: nn.ModuleList
    linear_v_adapter_list: nn.ModuleList

    def __init__(self, width: int, hidden: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, *, rotary: Rotary | None,
                 adapters: tuple[list[bool], int] | None) -> None:
        """`adapters`: (which invocations this block serves, rank), or None."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(width, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(width, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(width, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        if adapters is not None:
            if num_kv_heads * head_dim != width or num_heads * head_dim != width:
                raise ValueError("use_shared_attention_adapter needs num_key_value_heads == "
                                 "num_attention_heads (the adapters add 2 x hidden_size wide "
                                 "outputs to q, k and v)")
            used, rank = adapters
            for name in ("linear_q_adapter_list", "linear_k_adapter_list",
                         "linear_v_adapter_list"):
                self.add_module(name, adapter_list(used, width, rank, width))
        self.adapted = adapters is not None
        self.rotary = rotary
        # Scores scaled by sqrt(head_dim / 2): the head sees [h | embedding], twice hidden.
        self.params = AttentionParams(scale=(head_dim / 2) ** -0.5)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, *,
                cache: str, invocation: int) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.adapted:
            q = q + self.linear_q_adapter_list[invocation](x)
            k = k + self.linear_k_adapter_list[invocation](x)
            v = v + self.linear_v_adapter_list[invocation](x)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))  # [T, H, D]
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.rotary is not None:
            cos, sin = self.rotary.cos_sin(positions, ctx)
            q, k = self.rotary.rotate(q, cos, sin), self.rotary.rotate(k, cos, sin)
        return self.o_proj(ctx.attention(cache, q, k, v, self.params).flatten(1))  # type: ignore[no-any-return]


class AdaptedGatedMLP(nn.Module):
    """Zamba2's MLP: down(act(gate) * up), [gate | up] = gate_up_proj(x) + adapter_j(x)."""

    def __init__(self, hidden: int, intermediate: int, act: str, *, bias: bool,
                 used: list[bool], rank: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.gate_up_proj_adapter_list = adapter_list(used, hidden, rank, 2 * intermediate)
        self.act = activation(act)

    def forward(self, x: torch.Tensor, invocation: int) -> torch.Tensor:
        gate, up = (self.gate_up_proj(x) + self.gate_up_proj_adapter_list[invocation](x)
                    ).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)  # type: ignore[no-any-return]


class SharedTransformerBlock(nn.Module):
    """shared(h, embedding) as drawn above; `feed_forward` takes the invocation where it has
    adapters (`adapted_ffn`)."""

    def __init__(self, hidden: int, eps: float, attention: SharedAttention,
                 feed_forward: nn.Module, *, adapted_ffn: bool) -> None:
        super().__init__()
        self.self_attn = attention
        self.feed_forward = feed_forward
        self.input_layernorm = RMSNorm(2 * hidden, eps)
        self.pre_ff_layernorm = RMSNorm(hidden, eps)
        self.adapted_ffn = adapted_ffn

    def forward(self, h: torch.Tensor, embedding: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext, *, cache: str, invocation: int) -> torch.Tensor:
        x = self.input_layernorm(torch.cat([h, embedding], dim=-1))  # [T, 2 x hidden]
        x = self.pre_ff_layernorm(self.self_attn(x, positions, ctx, cache=cache,
                                                 invocation=invocation))
        if self.adapted_ffn:
            return self.feed_forward(x, invocation)  # type: ignore[no-any-return]
        return self.feed_forward(x)  # type: ignore[no-any-return]


class MambaBlock(nn.Module):
    """h + mamba(input_layernorm(h + extra)): a Mamba layer, or a hybrid layer's Mamba part
    (`extra` the shared block's projected output)."""

    def __init__(self, mamba: nn.Module, hidden: int, eps: float) -> None:
        super().__init__()
        self.mamba = mamba
        self.input_layernorm = RMSNorm(hidden, eps)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                embedding: torch.Tensor | None = None, extra: torch.Tensor | None = None
                ) -> torch.Tensor:
        # `embedding` unused: every layer is called with it (see HybridLayer).
        x = h if extra is None else h + extra
        return h + self.mamba(self.input_layernorm(x), positions, ctx)  # type: ignore[no-any-return]


class HybridLayer(nn.Module):
    """Layer `layer`, the shared block's `invocation`-th use; its attention writes and reads
    the KV cache `model.layers.{layer}.self_attn`. `shared_name`: the checkpoint's name
    for the block (Zamba2: shared_transformer, Zamba: shared_transf)."""

    def __init__(self, layer: int, invocation: int, shared: SharedTransformerBlock,
                 mamba_decoder: MambaBlock, hidden: int, *, shared_name: str) -> None:
        super().__init__()
        self.add_module(shared_name, shared)
        self.shared_name = shared_name
        self.linear = nn.Linear(hidden, hidden, bias=False)
        self.mamba_decoder = mamba_decoder
        self.cache, self.invocation = f"model.layers.{layer}.self_attn", invocation

    @property
    def shared(self) -> SharedTransformerBlock:
        return getattr(self, self.shared_name)  # type: ignore[no-any-return]

    def run_own(self, block: SharedTransformerBlock) -> None:
        """Run `block` from now on instead of the one shared with other layers."""
        setattr(self, self.shared_name, block)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                embedding: torch.Tensor) -> torch.Tensor:
        t = self.shared(h, embedding, positions, ctx, cache=self.cache,
                        invocation=self.invocation)
        return self.mamba_decoder(h, positions, ctx, extra=self.linear(t))  # type: ignore[no-any-return]
