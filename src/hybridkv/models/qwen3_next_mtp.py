"""Qwen3-Next / Qwen3.5's multi-token-prediction head (the checkpoints' `mtp.*` weights): one
more decoder layer that, from the target's hidden state at position p and the embedding of
token p + 1, predicts token p + 2.

    e = pre_fc_norm_embedding(embed(t[p + 1]))        (the target's embedding)
    g = pre_fc_norm_hidden(h[p])                      (the target's last hidden state, normed
                                                       by its final norm, as vLLM feeds it)
    x = fc([e, g])                                    [T, 2 hidden] -> [T, hidden]
    x = layers[0](x, p)                               full gated attention at position p,
                                                      then the MLP (or MoE) of the family
    out = norm(x)                                     -> the target's LM head: t[p + 2]

For more than one draft the head's own output stands in for h (it drafts recurrently). Its
attention layer is a layer of the KV cache plan (engine/mtp.py); its embedding and LM head
are the target's, shared, not copied. All norms are zero-centred, `x * (1 + w)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import FULL
from hybridkv.models.layers.attention import Attention
from hybridkv.models.layers.norms import RMSNorm
from hybridkv.models.qwen3_next import QWEN3_5_TYPES, per_expert, qwen3_next_layer
from hybridkv.models.text_config import TextConfig
from hybridkv.models.weights import load_named_weights
from hybridkv.worker.forward_context import ForwardContext
from hybridkv.worker.head.topk import HeadCandidates

# Families whose checkpoints carry this head, by model_type.
MTP_MODEL_TYPES = ("qwen3_next", *QWEN3_5_TYPES)
# The checkpoint's prefix of the head's tensors.
MTP_PREFIX = "mtp."
# The head's attention layer in the KV cache plan (before the draft prefix).
MTP_ATTENTION = "mtp.layers.0.self_attn"


class Qwen3NextMTP(nn.Module):
    """forward(token ids [T] (of p + 1), positions [T] (p), ctx, hidden [T, hidden] (h[p]))
    -> [T, hidden]; compute_logits / head_candidates: the target's head."""

    def __init__(self, config: dict[str, Any], target: CausalLM) -> None:
        super().__init__()
        cfg = TextConfig.from_hf(config)
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.model_type = cfg.model_type
        # Not a registered submodule: the target owns its parameters (and is not this
        # head's to move or load).
        self.__dict__["target"] = target
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, 1.0)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, 1.0)
        # Layer 0 of the family decides dense MLP or MoE, as the reference builds it; its
        # attention's cache is named apart from the target's layer 0.
        layer = qwen3_next_layer(cfg, 0, FULL)
        attention = layer.get_submodule("self_attn")
        assert isinstance(attention, Attention)
        attention.name = MTP_ATTENTION
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(hidden, eps, 1.0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                hidden: torch.Tensor) -> torch.Tensor:
        target: CausalLM = self.__dict__["target"]
        e = self.pre_fc_norm_embedding(target.embed(input_ids))
        g = self.pre_fc_norm_hidden(hidden.to(e.dtype))
        x = self.fc(torch.cat([e, g], dim=-1))
        for layer in self.layers:
            x = layer(x, positions, ctx)
        out: torch.Tensor = self.norm(x)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.__dict__["target"].compute_logits(hidden)  # type: ignore[no-any-return]

    def head_candidates(self, hidden: torch.Tensor, k: int) -> HeadCandidates | None:
        return self.__dict__["target"].head_candidates(hidden, k)  # type: ignore[no-any-return]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """From the checkpoint's `mtp.*` tensors (Hugging Face names); stacked experts are
        cut per expert as the target's are."""
        load_named_weights(self, per_expert(_unprefixed(weights)),
                           model_type=f"{self.model_type} MTP head", tied=False)


def _unprefixed(weights: Iterable[tuple[str, torch.Tensor]]
                ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield name.removeprefix(MTP_PREFIX), tensor
