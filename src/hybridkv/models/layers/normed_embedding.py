"""An embedding whose rows are RMS-normalised as they are read (Inkling, Inkling 2; their
checkpoints: `embed_tokens.embed_norm`)."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.layers.norms import RMSNorm


class NormedEmbedding(nn.Embedding):
    def __init__(self, vocab: int, hidden: int, eps: float) -> None:
        super().__init__(vocab, hidden)
        self.embed_norm = RMSNorm(hidden, eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(super().forward(ids))  # type: ignore[no-any-return]
