"""Gemma 3n text: AltUp, Laurel, per-layer inputs, activation sparsity and KV sharing.

- AltUp keeps `altup_num_inputs` copies of the hidden state; each layer runs on one
  ("active") copy predicted from all of them, then corrects every copy with its output.
- Laurel adds a low-rank residual branch next to attention.
- Per-layer inputs: a second embedding table gives every token a small vector per layer,
  mixed with a projection of the token's embedding, gated into each layer's output.
- Activation sparsity: in the first layers the MLP gate keeps only values above
  mean + std * Φ⁻¹(sparsity) of each token (a Gaussian top-k).
- KV sharing: the last `num_kv_shared_layers` layers compute queries only and read the KV
  cache of the last earlier layer of their attention type (`layer_mix.kv_sharing_targets`);
  with `kv_sharing_fast_prefill` they run on the sampled tokens only.

Hidden states are token-major here: [altup, tokens, hidden].
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.layer_mix import SLIDING, kv_shared_from, kv_sharing_targets, layer_kinds
from hybridkv.models.layers import (
    GatedMLP,
    RMSNorm,
    activation,
    apply_rope,
    rope_inv_freq,
    rope_key,
)
from hybridkv.models.llama import _rope_params
from hybridkv.models.weights import load_named_weights
from hybridkv.worker.attention import AttentionParams
from hybridkv.worker.forward_context import ForwardContext

# Parts of multimodal checkpoints that text generation does not use.
MULTIMODAL_PARTS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                    "model.embed_audio.", "model.multi_modal_projector.")


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a scale (Gemma 3n/4's value norm), in float32."""
    return nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class SharedKVAttention(nn.Module):
    """Gemma 3n/4 attention: q/k norms, a scale-free v norm, scaling 1, RoPE per layer
    type; a layer that reads another layer's KV has only q_proj, q_norm and o_proj.
    `k_eq_v` (Gemma 4 full layers): values are the keys before k_norm and RoPE."""

    def __init__(self, cfg: Mapping[str, Any], layer: int, *, sliding: bool, head_dim: int,
                 num_kv_heads: int, reads_shared_kv: bool, rope: Mapping[str, Any],
                 k_eq_v: bool = False) -> None:
        super().__init__()
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        bias = bool(cfg.get("attention_bias", False))
        self.name = f"model.layers.{layer}.self_attn"
        self.num_heads, self.num_kv_heads, self.head_dim = heads, num_kv_heads, head_dim
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.reads_shared_kv = reads_shared_kv
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.q_norm = RMSNorm(head_dim, self.eps)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        if not reads_shared_kv:
            self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
            self.v_proj = None if k_eq_v else nn.Linear(hidden, num_kv_heads * head_dim,
                                                        bias=bias)
            self.k_norm = RMSNorm(head_dim, self.eps)
        inv_freq, self.rope_scaling = rope_inv_freq(head_dim, rope)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_key = rope_key(head_dim, rope)
        self.params = AttentionParams(
            scale=1.0, sliding_window=int(cfg["sliding_window"]) if sliding else None)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        cos, sin = ctx.rope_cos_sin(positions, self.rope_key, self.inv_freq, self.rope_scaling)
        q = apply_rope(self.q_norm(self.q_proj(h).unflatten(-1, (self.num_heads, -1))),
                       cos, sin)
        k = v = None
        if not self.reads_shared_kv:
            raw_k = self.k_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim))
            raw_v = raw_k if self.v_proj is None else self.v_proj(h).unflatten(
                -1, (self.num_kv_heads, self.head_dim))
            k = apply_rope(self.k_norm(raw_k), cos, sin)
            v = rms_normalize(raw_v, self.eps)
        out = ctx.attention(self.name, q, k, v, self.params)
        return self.o_proj(out.flatten(1))  # type: ignore[no-any-return]


class PerLayerInputsModel(nn.Module):
    """A decoder stack whose tokens also get a small vector per layer (Gemma 3n and 4): a
    per-layer embedding of the token mixed with a projection of its main embedding. The
    modules sit at the top of the model, named as in the checkpoints."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        self.hidden, self.num_layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
        self.per_layer_dim = int(cfg["hidden_size_per_layer_input"])
        self.per_layer_vocab = int(cfg.get("vocab_size_per_layer_input") or cfg["vocab_size"])
        width = self.num_layers * self.per_layer_dim
        self.embed_tokens_per_layer = nn.Embedding(self.per_layer_vocab, width)
        self.per_layer_model_projection = nn.Linear(self.hidden, width, bias=False)
        self.per_layer_projection_norm = RMSNorm(self.per_layer_dim,
                                                 float(cfg.get("rms_norm_eps", 1e-6)))

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[tokens, layers, per_layer_dim]"""
        shape = (self.num_layers, self.per_layer_dim)
        ids = torch.where(input_ids < self.per_layer_vocab, input_ids, 0)
        emb = self.embed_tokens_per_layer(ids) * torch.tensor(self.per_layer_dim ** 0.5,
                                                              dtype=embeds.dtype)
        proj = self.per_layer_model_projection(embeds) * torch.tensor(self.hidden ** -0.5,
                                                                      dtype=embeds.dtype)
        proj = self.per_layer_projection_norm(proj.unflatten(-1, shape))
        return (proj + emb.unflatten(-1, shape)) * torch.tensor(2.0 ** -0.5, dtype=embeds.dtype)


class AltUp(nn.Module):
    def __init__(self, hidden: int, num_inputs: int, active: int, eps: float) -> None:
        super().__init__()
        self.num_inputs, self.active, self.hidden = num_inputs, active, hidden
        self.correct_output_scale = nn.Parameter(torch.zeros(hidden))
        self.correction_coefs = nn.Linear(num_inputs, num_inputs, bias=False)
        self.prediction_coefs = nn.Linear(num_inputs, num_inputs ** 2, bias=False)
        self.modality_router = nn.Linear(hidden, num_inputs, bias=False)
        self.router_norm = RMSNorm(hidden, eps)

    def _modalities(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.modality_router(self.router_norm(x) * (1.0 / self.hidden))
        return torch.tanh(routed.float()).to(x.dtype)  # [T, A]

    def predict(self, hs: torch.Tensor) -> torch.Tensor:
        """hs [A, T, H] -> predictions [A, T, H]: each copy plus a per-token mix of all."""
        coefs = self.prediction_coefs(self._modalities(hs[self.active]))
        coefs = coefs.unflatten(-1, (self.num_inputs, self.num_inputs)).transpose(1, 2)
        mixed = torch.matmul(hs.permute(1, 2, 0), coefs)  # [T, H, A]
        return mixed.permute(2, 0, 1) + hs

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """Spread the active copy's innovation (layer output - its prediction) to all."""
        coefs = self.correction_coefs(self._modalities(activated)) + 1.0  # [T, A]
        innovation = activated - predictions[self.active]
        return innovation.unsqueeze(0) * coefs.T.unsqueeze(-1) + predictions


class Laurel(nn.Module):
    def __init__(self, hidden: int, rank: int, eps: float) -> None:
        super().__init__()
        self.linear_left = nn.Linear(hidden, rank, bias=False)
        self.linear_right = nn.Linear(rank, hidden, bias=False)
        self.post_laurel_norm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))  # type: ignore[no-any-return]


class SparseMLP(GatedMLP):
    """GatedMLP whose gate may keep only its largest values (activation sparsity)."""

    def __init__(self, hidden: int, intermediate: int, act: str, sparsity: float) -> None:
        super().__init__(hidden, intermediate, act)
        # Φ⁻¹(sparsity): the gate keeps values above mean + std * this, per token.
        self.std_multiplier = float(torch.distributions.Normal(0.0, 1.0).icdf(
            torch.tensor(sparsity, dtype=torch.float32))) if sparsity > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        if self.std_multiplier is not None:
            cutoff = gate.mean(-1, keepdim=True) + gate.std(
                -1, keepdim=True, unbiased=False) * self.std_multiplier
            gate = nn.functional.relu(gate - cutoff)
        return self.down_proj(self.act(gate) * self.up_proj(x))  # type: ignore[no-any-return]


def intermediate_sizes(cfg: Mapping[str, Any], n: int) -> list[int]:
    size = cfg["intermediate_size"]
    return [int(s) for s in size] if isinstance(size, list) else [int(size)] * n


def gemma_rope(cfg: Mapping[str, Any], sliding: bool) -> Mapping[str, Any]:
    return _rope_params(cfg, SLIDING if sliding else "full")


class Gemma3nDecoderLayer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], layer: int, *, sliding: bool,
                 reads_shared_kv: bool, intermediate: int, sparsity: float) -> None:
        super().__init__()
        hidden = int(cfg["hidden_size"])
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        heads = int(cfg["num_attention_heads"])
        self.self_attn = SharedKVAttention(
            cfg, layer, sliding=sliding, head_dim=int(cfg.get("head_dim") or hidden // heads),
            num_kv_heads=int(cfg["num_key_value_heads"]), reads_shared_kv=reads_shared_kv,
            rope=gemma_rope(cfg, sliding))
        act = str(cfg.get("hidden_activation") or "gelu_pytorch_tanh")
        self.mlp = SparseMLP(hidden, intermediate, act, sparsity)
        for norm in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm",
                     "post_per_layer_input_norm"):
            setattr(self, norm, RMSNorm(hidden, eps))
        self.altup = AltUp(hidden, int(cfg.get("altup_num_inputs", 4)),
                           int(cfg.get("altup_active_idx", 0)), eps)
        self.correct_scale = bool(cfg.get("altup_correct_scale", True))
        self.laurel = Laurel(hidden, int(cfg.get("laurel_rank", 64)), eps)
        per_layer = int(cfg["hidden_size_per_layer_input"])
        self.per_layer_input_gate = nn.Linear(hidden, per_layer, bias=False)
        self.per_layer_projection = nn.Linear(per_layer, hidden, bias=False)
        self.act = activation(act)

    def forward(self, hs: torch.Tensor, per_layer_input: torch.Tensor,
                positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        predictions = self.altup.predict(hs)
        active = predictions[self.altup.active]
        normed = self.input_layernorm(active)
        laurel = self.laurel(normed)
        attn = self.post_attention_layernorm(self.self_attn(normed, positions, ctx))
        attn_laurel = (active + attn + laurel) / math.sqrt(2)
        ffw = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(
            attn_laurel)))
        corrected = self.altup.correct(predictions, attn_laurel + ffw)
        first = corrected[self.altup.active]
        if self.correct_scale:
            first = first * self.altup.correct_output_scale
        gated = self.act(self.per_layer_input_gate(first)) * per_layer_input
        extra = self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return torch.cat([corrected[:1], corrected[1:] + extra], dim=0)


class Gemma3nModel(PerLayerInputsModel):
    def __init__(self, cfg: Mapping[str, Any], config: Mapping[str, Any]) -> None:
        super().__init__(cfg)
        hidden, n = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        kinds = layer_kinds(config)
        self.targets = kv_sharing_targets(config, kinds)
        sparsity = cfg.get("activation_sparsity_pattern")
        if sparsity is None:  # transformers' default: the first 10 layers are sparse
            sparsity = [0.95 if i < 10 and n > 10 else 0.0 for i in range(n)]
        sizes = intermediate_sizes(cfg, n)
        self.embed_tokens = nn.Embedding(int(cfg["vocab_size"]), hidden)
        self.layers = nn.ModuleList(
            Gemma3nDecoderLayer(cfg, i, sliding=kinds[i] == (SLIDING,),
                                reads_shared_kv=i in self.targets, intermediate=sizes[i],
                                sparsity=float(sparsity[i])) for i in range(n))
        self.norm = RMSNorm(hidden, eps)
        num_inputs = int(cfg.get("altup_num_inputs", 4))
        self.altup_projections = nn.ModuleList(
            nn.Linear(hidden, hidden, bias=False) for _ in range(1, num_inputs))
        self.altup_unembed_projections = nn.ModuleList(
            nn.Linear(hidden, hidden, bias=False) for _ in range(1, num_inputs))


def _match_magnitude(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    magnitude = torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True).clamp(min=1e-5))
    return x * target / magnitude


class KVSharingGemmaLM(nn.Module):
    """What Gemma 3n and Gemma 4 share around their decoder stack: a tied LM head with
    optional final soft-capping, the KV-sharing layers (`model.targets`) and where fast
    prefill may start, and the checkpoint tensors that text generation leaves unused."""

    def __init__(self, config: Mapping[str, Any], model: nn.Module) -> None:
        super().__init__()
        cfg = config.get("text_config") or config
        self.model = model
        self.lm_head = nn.Linear(int(cfg["hidden_size"]), int(cfg["vocab_size"]), bias=False)
        self.tied = bool(config.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True)))
        if self.tied:
            self.lm_head.weight = model.embed_tokens.weight
        self.final_softcap = cfg.get("final_logit_softcapping")
        targets: dict[int, int] = model.targets
        self.kv_shared_from = kv_shared_from(targets, len(model.layers))
        self.model_type = str(cfg["model_type"])
        # Older checkpoints keep k/v weights for KV-sharing layers; nothing reads them.
        self.unused_weights = MULTIMODAL_PARTS + tuple(
            f"model.layers.{i}.self_attn.{part}." for i in targets
            for part in ("k_proj", "v_proj", "k_norm", "v_norm"))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits  # type: ignore[no-any-return]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights, model_type=self.model_type, tied=self.tied,
                           unused=self.unused_weights)


class Gemma3nForCausalLM(KVSharingGemmaLM):
    """forward(token ids [T], positions [T], ctx) -> hidden [T, hidden] (or, with fast
    prefill, the sampled tokens' rows); compute_logits(hidden) -> [N, vocab]."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = config.get("text_config") or config
        super().__init__(config, Gemma3nModel(cfg, config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        m = self.model
        h0 = m.embed_tokens(input_ids) * torch.tensor(m.hidden ** 0.5,
                                                      dtype=m.embed_tokens.weight.dtype)
        per_layer = m.per_layer_inputs(input_ids, h0)  # [T, L, P]
        target = torch.mean(h0 ** 2, dim=-1, keepdim=True) ** 0.5
        hs = torch.stack([h0, *(_match_magnitude(proj(h0), target)
                                for proj in m.altup_projections)])
        for i, layer in enumerate(m.layers):
            if i == self.kv_shared_from:
                ctx, keep = ctx.enter_kv_shared_layers()
                if keep is not None:
                    hs, per_layer, positions = hs[:, keep], per_layer[keep], positions[keep]
            hs = layer(hs, per_layer[:, i], positions, ctx)
        target = torch.mean(hs[0] ** 2, dim=-1, keepdim=True) ** 0.5
        outs = [hs[0], *(_match_magnitude(proj(hs[j + 1]), target)
                         for j, proj in enumerate(m.altup_unembed_projections))]
        return m.norm(torch.stack(outs).mean(dim=0))  # type: ignore[no-any-return]
