"""The forward context: what attention and state layers need for one step (the backend,
KV views, per-group metadata), passed explicitly through the model (no globals)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridkv.worker.attention import AttentionBackend, AttentionMetadata, AttentionParams
from hybridkv.worker.mla import MLAParams, mla_forward


@dataclass
class ForwardContext:
    """Everything attention layers need for one step, passed explicitly (no globals)."""

    backend: AttentionBackend
    kv_caches: Mapping[str, Any]  # layer name -> its KV view (or state tensors)
    metadata: Sequence[Any]  # per group: AttentionMetadata, or StateMetadata for states
    layer_group: Mapping[str, int]  # layer name -> group id
    # RoPE cos/sin of this step's positions, per distinct RoPE parameters.
    rope_cache: dict[object, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # KV-sharing fast prefill (set by the runner when enabled): the layers from a model's
    # `kv_shared_from` on write no KV, so only the tokens whose logits are sampled need them.
    # `kv_shared_tokens` indexes those tokens; `kv_shared_ctx` is the context of that batch.
    kv_shared_tokens: torch.Tensor | None = None
    kv_shared_ctx: ForwardContext | None = None

    def enter_kv_shared_layers(self) -> tuple[ForwardContext, torch.Tensor | None]:
        """Called by a model before its first KV-sharing layer: (the context for the rest of
        the layers, the token index to keep, or None to keep every token)."""
        if self.kv_shared_ctx is None:
            return self, None
        return self.kv_shared_ctx, self.kv_shared_tokens

    def state(self, layer_name: str) -> tuple[Any, tuple[torch.Tensor, ...]]:
        """A state layer's group metadata (StateMetadata) and its state tensors."""
        return self.metadata[self.layer_group[layer_name]], self.kv_caches[layer_name]

    def rope_cos_sin(self, positions: torch.Tensor, key: object, inv_freq: torch.Tensor,
                     scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, D] cos and sin, computed once per step for layers whose RoPE parameters
        (`key`, see `rope_key`) are equal."""
        cached = self.rope_cache.get(key)
        if cached is None:
            freqs = positions.float().unsqueeze(-1) * inv_freq
            cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1).unsqueeze(1) * scaling
            sin = torch.cat([freqs.sin(), freqs.sin()], dim=-1).unsqueeze(1) * scaling
            cached = self.rope_cache[key] = (cos, sin)
        return cached

    def attention(self, layer_name: str, q: torch.Tensor, k: torch.Tensor | None,
                  v: torch.Tensor | None, params: AttentionParams) -> torch.Tensor:
        """Attend over the layer's KV cache after writing k/v; k = v = None for a layer that
        reads another layer's cache (KV sharing), already written earlier in this step."""
        meta = self.metadata[self.layer_group[layer_name]]
        assert isinstance(meta, AttentionMetadata)
        return self.backend.forward(q, k, v, self.kv_caches[layer_name], meta, params)

    def mla_attention(self, layer_name: str, q: torch.Tensor, latent: torch.Tensor,
                      kv_b_weight: torch.Tensor, params: MLAParams) -> torch.Tensor:
        """Multi-head latent attention (worker/mla.py): write the layer's latents, attend
        over them up-projected by kv_b_weight. Returns [T, H, v_head_dim]."""
        meta = self.metadata[self.layer_group[layer_name]]
        assert isinstance(meta, AttentionMetadata)
        return mla_forward(q, latent, self.kv_caches[layer_name], meta, kv_b_weight, params)
