"""What every causal LM here shares around its decoder layers."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from hybridkv.models.weights import load_named_weights
from hybridkv.worker.forward_context import ForwardContext


class CausalLM(nn.Module):
    """embed (x embedding_multiplier) -> layers -> final norm; logits = lm_head (x
    lm_head_multiplier / logits_scaling, the µP factors of Falcon-H1 and Granite).
    Subclasses set `self.model` with `layers` and the embedding and norm named as in their
    checkpoints (`embed_name`, `norm_name`)."""

    model_type: ClassVar[str]
    embed_name: ClassVar[str] = "embed_tokens"
    norm_name: ClassVar[str] = "norm"

    def __init__(self, config: Mapping[str, Any], model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.lm_head = nn.Linear(int(config["hidden_size"]), int(config["vocab_size"]),
                                 bias=False)
        self.tied = bool(config.get("tie_word_embeddings", False))
        if self.tied:
            self.lm_head.weight = getattr(self.model, self.embed_name).weight
        self.embedding_multiplier = float(config.get("embedding_multiplier", 1.0))
        self.logits_multiplier = float(config.get("lm_head_multiplier", 1.0)) / float(
            config.get("logits_scaling", 1.0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        h = getattr(self.model, self.embed_name)(input_ids)
        if self.embedding_multiplier != 1.0:
            h = h * self.embedding_multiplier
        for layer in self.model.layers:  # type: ignore[union-attr]
            h = layer(h, positions, ctx)
        return getattr(self.model, self.norm_name)(h)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return logits * self.logits_multiplier if self.logits_multiplier != 1.0 else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights, model_type=self.model_type, tied=self.tied)
