"""The forward context: what attention and state layers need for one step (the backend,
KV views, per-group metadata), passed explicitly through the model (no globals)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridkv.worker.attention.backend import AttentionBackend, AttentionMetadata, AttentionParams
from hybridkv.worker.attention.mla import MLAParams, mla_forward


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 1, D] cos and sin of positions [T] (half-split layout: the angles twice)."""
    freqs = positions.float().unsqueeze(-1) * inv_freq
    cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1).unsqueeze(1) * scaling
    sin = torch.cat([freqs.sin(), freqs.sin()], dim=-1).unsqueeze(1) * scaling
    return cos, sin


@dataclass
class RopeTables:
    """cos/sin of positions 0..n-1 per distinct RoPE parameters, kept by the runner across
    steps: a step looks its positions up (two row gathers) instead of computing them again
    (about ten small ops per parameter set). A table grows by doubling to cover the highest
    position asked for; its rows equal `rope_cos_sin` of the same positions exactly (the same
    element-wise ops)."""

    tables: dict[object, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def cos_sin(self, positions: torch.Tensor, max_position: int, key: object,
                inv_freq: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.tables.get(key)
        if table is None or table[0].shape[0] <= max_position:
            size = max(1024, 1 << max_position.bit_length())
            table = self.tables[key] = rope_cos_sin(
                torch.arange(size, device=inv_freq.device), inv_freq, scaling)
        cos, sin = table
        return cos.index_select(0, positions), sin.index_select(0, positions)


@dataclass
class ForwardContext:
    """Everything attention layers need for one step, passed explicitly (no globals)."""

    backend: AttentionBackend
    kv_caches: Mapping[str, Any]  # layer name -> its KV view (or state tensors)
    metadata: Sequence[Any]  # per group: AttentionMetadata, or StateMetadata for states
    layer_group: Mapping[str, int]  # layer name -> group id
    # RoPE cos/sin of this step's positions, per distinct RoPE parameters.
    rope_cache: dict[object, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # The runner's tables across steps, and the step's highest position (None: no tables).
    rope_tables: RopeTables | None = None
    max_position: int = 0
    # KV-sharing fast prefill (set by the runner when enabled): the layers from a model's
    # `kv_shared_from` on write no KV, so only the tokens whose logits are sampled need them.
    # `kv_shared_tokens` indexes those tokens; `kv_shared_ctx` is the context of that batch.
    kv_shared_tokens: torch.Tensor | None = None
    kv_shared_ctx: ForwardContext | None = None
    # A step where some tokens sample nothing (a prompt's earlier tokens): the rows that
    # sample and the context of that cut batch. A model's last layer then writes K/V for
    # every token and computes the rest for those rows only (nothing reads the others);
    # it sets `rows_cut` when it returned only those rows.
    sampled_tokens: torch.Tensor | None = None
    sampled_ctx: ForwardContext | None = None
    rows_cut: bool = False

    def enter_kv_shared_layers(self) -> tuple[ForwardContext, torch.Tensor | None]:
        """Called by a model before its first KV-sharing layer: (the context for the rest of
        the layers, the token index to keep, or None to keep every token)."""
        if self.kv_shared_ctx is None:
            return self, None
        return self.kv_shared_ctx, self.kv_shared_tokens

    def cut_to_sampled(self, layer_name: str
                       ) -> tuple[ForwardContext, torch.Tensor] | None:
        """(the cut batch's context, the sampled rows) when the step has rows that sample
        nothing and `layer_name`'s group is plain attention pages (q4 pages keep their
        step's full-precision keys per layer call), else None."""
        if self.sampled_ctx is None or self.sampled_tokens is None:
            return None
        meta = self.metadata[self.layer_group[layer_name]]
        if not isinstance(meta, AttentionMetadata) or meta.key_groups:
            return None
        return self.sampled_ctx, self.sampled_tokens

    def write_kv(self, layer_name: str, k: torch.Tensor | None, v: torch.Tensor | None,
                 params: AttentionParams) -> None:
        """The layer's K/V of this step into their slots, without attending."""
        meta = self.metadata[self.layer_group[layer_name]]
        self.backend.write(k, v, self.kv_caches[layer_name], meta, params)

    def state(self, layer_name: str) -> tuple[Any, tuple[torch.Tensor, ...]]:
        """A state layer's group metadata (StateMetadata) and its state tensors."""
        return self.metadata[self.layer_group[layer_name]], self.kv_caches[layer_name]

    def rope_cos_sin(self, positions: torch.Tensor, key: object, inv_freq: torch.Tensor,
                     scaling: float, *, step_positions: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, D] cos and sin, computed once per step for layers whose RoPE parameters
        (`key`, see `rope_key`) are equal; looked up in the runner's tables when it keeps
        them and `positions` are the step's (at most `max_position`)."""
        cached = self.rope_cache.get(key)
        if cached is None:
            if self.rope_tables is not None and step_positions:
                cached = self.rope_tables.cos_sin(positions, self.max_position, key,
                                                  inv_freq, scaling)
            else:
                cached = rope_cos_sin(positions, inv_freq, scaling)
            self.rope_cache[key] = cached
        return cached

    def attention(self, layer_name: str, q: torch.Tensor, k: torch.Tensor | None,
                  v: torch.Tensor | None, params: AttentionParams) -> torch.Tensor:
        """Attend over the layer's KV cache after writing k/v; k = v = None for a layer that
        reads another layer's cache (KV sharing), already written earlier in this step."""
        meta = self.metadata[self.layer_group[layer_name]]
        assert isinstance(meta, AttentionMetadata)
        kv_cache = self.kv_caches[layer_name]
        out = self.backend.forward(q, k, v, kv_cache, meta, params)
        if meta.key_groups and kv_cache.data_ptr() not in meta.shared_views:
            # q4 K/V pages: the layer's full-precision keys of this step (a chunk's worth)
            # are read by this layer alone.
            meta.fresh.pop(kv_cache.data_ptr(), None)
        return out

    def mla_attention(self, layer_name: str, q: torch.Tensor, latent: torch.Tensor,
                      kv_b_weight: torch.Tensor, params: MLAParams) -> torch.Tensor:
        """Multi-head latent attention (worker/attention/mla.py): write the layer's latents, attend
        over them up-projected by kv_b_weight. Returns [T, H, v_head_dim]."""
        meta = self.metadata[self.layer_group[layer_name]]
        assert isinstance(meta, AttentionMetadata)
        return mla_forward(q, latent, self.kv_caches[layer_name], meta, kv_b_weight, params)
