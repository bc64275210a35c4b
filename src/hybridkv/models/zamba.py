"""Zamba2: Mamba2 layers; "hybrid" layers first run a shared transformer block (attention
+ MLP over [h | original embedding], layers/shared_block.py) and add its projection to their
Mamba input. `num_mem_blocks` blocks take turns (ABAB...); each use has its own KV cache and
its own low-rank adapters. Zamba (v1): the same with multi-head Mamba1 layers and one block
without RoPE or adapters.

The blocks are shared only where transformers shares them: it ties the later uses to the
first `num_mem_blocks` blocks when `tie_word_embeddings` is on (then checkpoints hold the
first copies only); otherwise every hybrid layer keeps a copy of its own."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import FULL, with_family_defaults
from hybridkv.models.layers.mamba1_heads import MultiHeadMamba1Mixer
from hybridkv.models.layers.mamba2 import Mamba2Mixer
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.layers.shared_block import (
    AdaptedGatedMLP,
    HybridLayer,
    MambaBlock,
    SharedAttention,
    SharedTransformerBlock,
)
from hybridkv.models.text_config import TextConfig
from hybridkv.models.weights import load_named_weights


def mamba2_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The config in the field names Mamba2Mixer reads. Zamba2's mixer always has a conv
    bias, and its gated norm a fixed eps of 1e-5."""
    hidden = int(raw["hidden_size"])
    inner = int(float(raw.get("mamba_expand", 2)) * hidden)
    heads = int(raw.get("n_mamba_heads", 8))
    bias = bool(raw.get("add_bias_linear", False))
    return {**raw, "mamba_num_heads": heads,
            "mamba_head_dim": int(raw.get("mamba_headdim") or inner // heads),
            "n_groups": int(raw.get("mamba_ngroups", 1)), "use_bias": bias,
            "projectors_bias": bias, "use_conv_bias": True, "layer_norm_epsilon": 1e-5,
            "time_step_min": float(raw.get("time_step_min", 0.001))}


def zamba2_block(cfg: TextConfig, block: int, num_uses: int) -> SharedTransformerBlock:
    """Shared block `block`: it serves invocations j with j % num_mem_blocks == block."""
    raw, hidden = cfg.raw, cfg.hidden_size
    num_blocks, rank = int(raw.get("num_mem_blocks", 1)), int(raw.get("adapter_rank", 128))
    used = [j % num_blocks == block for j in range(num_uses)]
    head_dim = int(raw.get("attention_head_dim") or 2 * hidden // cfg.num_heads)
    attention = SharedAttention(
        2 * hidden, hidden, cfg.num_heads, cfg.num_kv_heads, head_dim,
        rotary=Rotary.from_config(raw, head_dim, FULL) if raw.get("use_mem_rope") else None,
        adapters=(used, rank) if raw.get("use_shared_attention_adapter") else None)
    mlp = AdaptedGatedMLP(hidden, cfg.intermediate_size, cfg.hidden_act,
                          bias=bool(raw.get("add_bias_linear", False)), used=used, rank=rank)
    return SharedTransformerBlock(hidden, cfg.rms_norm_eps, attention, mlp, adapted_ffn=True)


def zamba_block(cfg: TextConfig) -> SharedTransformerBlock:
    """Zamba's one shared block: attention without positions or adapters, a SwiGLU-style
    gated MLP (gelu by default)."""
    raw, hidden = cfg.raw, cfg.hidden_size
    if int(raw.get("attention_hidden_size") or 2 * hidden) != 2 * hidden:
        raise ValueError(f"zamba: attention_hidden_size must be 2 x hidden_size "
                         f"({2 * hidden}), the width of [h | embedding]")
    head_dim = int(raw.get("attention_head_dim") or 2 * hidden // cfg.num_heads)
    attention = SharedAttention(2 * hidden, hidden, cfg.num_heads, cfg.num_kv_heads, head_dim,
                                rotary=None, adapters=None)
    mlp = GatedMLP(hidden, cfg.intermediate_size, cfg.hidden_act)
    return SharedTransformerBlock(hidden, cfg.rms_norm_eps, attention, mlp, adapted_ffn=False)


def hybrid_layers(cfg: TextConfig, mixer: Callable[[int], nn.Module],
                  block: Callable[[int], SharedTransformerBlock], *, num_blocks: int,
                  shared_name: str) -> Iterator[nn.Module]:
    """Mamba layers; hybrid layer i, the j-th, runs block j % num_blocks (`block(b)` builds
    block b)."""
    hybrid_ids = [i for i, parts in enumerate(cfg.layer_kinds) if FULL in parts]
    blocks: list[SharedTransformerBlock] = []
    for i in range(cfg.num_layers):
        mamba = MambaBlock(mixer(i), cfg.hidden_size, cfg.rms_norm_eps)
        if i not in hybrid_ids:
            yield mamba
            continue
        j = hybrid_ids.index(i)
        if cfg.tie_word_embeddings and j >= num_blocks:
            shared = blocks[j % num_blocks]  # the same module: weights shared
        else:
            shared = block(j % num_blocks)
        blocks.append(shared)
        yield HybridLayer(i, j, shared, mamba, cfg.hidden_size, shared_name=shared_name)


class _ZambaLM(CausalLM):
    norm_name = "final_layernorm"

    def __init__(self, cfg: TextConfig, layers: Iterable[nn.Module]) -> None:
        super().__init__(cfg, layers)
        # Hybrid layers running a block an earlier layer holds -> their checkpoint prefix.
        holders: set[int] = set()
        self.borrowers: dict[int, str] = {}
        for i, layer in enumerate(self.model.layers):  # type: ignore[arg-type]
            if isinstance(layer, HybridLayer):
                if id(layer.shared) in holders:
                    self.borrowers[i] = f"model.layers.{i}.{layer.shared_name}."
                holders.add(id(layer.shared))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As transformers loads a tied model: a later use keeps the shared block unless the
        checkpoint holds a copy of its own with other values; then it runs that copy."""
        copies: dict[int, dict[str, torch.Tensor]] = {i: {} for i in self.borrowers}

        def shared_ones() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                layer = next((i for i, p in self.borrowers.items() if name.startswith(p)), None)
                if layer is None:
                    yield name, tensor
                else:
                    copies[layer][name[len(self.borrowers[layer]):]] = tensor

        super().load_weights(shared_ones())
        for i, tensors in copies.items():
            layer = self.model.layers[i]
            params = dict(layer.shared.named_parameters())
            if all(n in params and torch.equal(t.to(params[n].dtype), params[n])
                   for n, t in tensors.items()):
                continue  # none, or the same values: stays tied
            own = copy.deepcopy(layer.shared)
            load_named_weights(own, tensors.items(), model_type=self.cfg.model_type, tied=False)
            layer.run_own(own)

    def per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The original embeddings [T, layers, hidden] (a view): every hybrid layer's shared
        block reads them beside its input."""
        return h.unsqueeze(1).expand(-1, self.cfg.num_layers, -1)


class Zamba2ForCausalLM(_ZambaLM):
    def __init__(self, config: Mapping[str, Any]) -> None:
        # A config without intermediate_size gets transformers' 4 x hidden.
        cfg = TextConfig.from_hf(with_family_defaults(config), eps=1e-5, act="gelu", tied=True)
        fields = mamba2_fields(cfg.raw)
        num_uses = sum(FULL in parts for parts in cfg.layer_kinds)
        super().__init__(cfg, hybrid_layers(
            cfg, lambda i: Mamba2Mixer(fields, i), lambda b: zamba2_block(cfg, b, num_uses),
            num_blocks=int(cfg.raw.get("num_mem_blocks", 1)), shared_name="shared_transformer"))


class ZambaForCausalLM(_ZambaLM):
    """Zamba (v1): multi-head Mamba1 layers, one shared block (no RoPE, no adapters)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config, eps=1e-5, act="gelu", tied=True)
        super().__init__(cfg, hybrid_layers(
            cfg, lambda i: MultiHeadMamba1Mixer(cfg.raw, i), lambda b: zamba_block(cfg),
            num_blocks=1, shared_name="shared_transf"))
