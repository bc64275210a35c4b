"""Per-layer inputs (Gemma 3n and 4): every token also gets a small vector per layer, a
per-layer embedding of the token mixed with a projection of its main embedding, gated into
each layer's output."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.layers.activations import activation
from hybridkv.models.layers.norms import RMSNorm


class PerLayerInputsModel(nn.Module):
    """The `model` container of such a decoder: the per-layer embedding and projection sit
    at its top, named as in the checkpoints (the CausalLM adds the embedding, layers and
    norm)."""

    def __init__(self, hidden: int, num_layers: int, per_layer_dim: int,
                 per_layer_vocab: int, eps: float) -> None:
        super().__init__()
        self.hidden, self.num_layers = hidden, num_layers
        self.per_layer_dim, self.per_layer_vocab = per_layer_dim, per_layer_vocab
        width = num_layers * per_layer_dim
        self.embed_tokens_per_layer = nn.Embedding(per_layer_vocab, width)
        self.per_layer_model_projection = nn.Linear(hidden, width, bias=False)
        self.per_layer_projection_norm = RMSNorm(per_layer_dim, eps)

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


class PerLayerInputLayer(nn.Module):
    """A decoder layer that adds its per-layer input: norm(proj(act(gate(x)) * input))."""

    def init_per_layer_input(self, hidden: int, per_layer_dim: int, act: str,
                             eps: float) -> None:
        self.per_layer_act = activation(act)
        self.per_layer_input_gate = nn.Linear(hidden, per_layer_dim, bias=False)
        self.per_layer_projection = nn.Linear(per_layer_dim, hidden, bias=False)
        self.post_per_layer_input_norm = RMSNorm(hidden, eps)

    def per_layer_residual(self, x: torch.Tensor, per_layer_input: torch.Tensor
                           ) -> torch.Tensor:
        gated = self.per_layer_act(self.per_layer_input_gate(x)) * per_layer_input
        return self.post_per_layer_input_norm(  # type: ignore[no-any-return]
            self.per_layer_projection(gated))
