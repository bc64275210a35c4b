"""RWKV-4: a pure recurrent model. Every layer is an RwkvBlock (time mixing, then channel
mixing, LayerNorms with biases); no attention, so the KV cache holds one state group and
prefix hits come from state checkpoints alone (as for Mamba). Checkpoints keep the model
under `rwkv.` with `blocks`, `ln_out` and an lm head called `head`.

`rescale_every` (default 6): at inference transformers divides each block's two output
projections by 2^(layer // rescale_every) and the hidden states by 2 after every
`rescale_every`-th block; the LayerNorms absorb the scale but for their eps, so it is
done here too (exactly: scaling by powers of two). 0 or less: no rescaling."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import with_family_defaults
from hybridkv.models.layers.rwkv import RwkvBlock
from hybridkv.models.text_config import TextConfig
from hybridkv.models.weights import renamed

NAMES = ((r"^rwkv\.blocks\.", "model.layers."), (r"^rwkv\.", "model."), (r"^head\.", "lm_head."))
SCALED = re.compile(r"model\.layers\.(\d+)\.(attention\.output|feed_forward\.value)\.weight")


class RwkvForCausalLM(CausalLM):
    embed_name = "embeddings"
    norm_name = "ln_out"

    def __init__(self, config: Mapping[str, Any]) -> None:
        raw = with_family_defaults(config.get("text_config") or config)
        cfg = TextConfig.from_hf(raw, eps=1e-5)
        every = int(raw.get("rescale_every") or 0)
        super().__init__(cfg, (
            RwkvBlock(cfg.hidden_size, int(raw["attention_hidden_size"]), cfg.intermediate_size,
                      cfg.rms_norm_eps, i, halve=every > 0 and (i + 1) % every == 0)
            for i in range(cfg.num_layers)))
        self.rescale_every = every
        # The final norm is a LayerNorm at torch's default eps, whatever the blocks use.
        self.model.ln_out = nn.LayerNorm(cfg.hidden_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._rescaled(renamed(weights, NAMES)))

    def _rescaled(self, weights: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            match = SCALED.fullmatch(name)
            if match and self.rescale_every > 0:
                tensor = tensor / 2 ** (int(match.group(1)) // self.rescale_every)
            yield name, tensor
