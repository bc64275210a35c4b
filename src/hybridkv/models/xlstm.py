"""xLSTM (the xLSTM-7B architecture): a pure recurrent model of mLSTM blocks,

    h = h + mlstm_layer(norm_mlstm(h));   h = h + ffn(norm_ffn(h))    (RMSNorms, SwiGLU FFN)

with no attention, so the KV cache holds one state group (each layer's mLSTM memory, see
layers/mlstm.py) and prefix hits come from state checkpoints alone, as for Mamba. Logits are
soft-capped (`output_logit_soft_cap`), gate pre-activations too (`gate_soft_cap`).
Checkpoints keep the model under `backbone.` with `blocks` and `out_norm`; with
`weight_mode="fused"` the projections come fused (`qkv_opreact` = [q | k | v | o],
`ifgate_preact` = [i | f], `proj_up_gate_z` = [gate | up]) and are cut apart on load."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from hybridkv.models.base import CausalLM
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.mlstm import MLstmLayer
from hybridkv.models.text_config import TextConfig
from hybridkv.models.weights import renamed, split_rows

NAMES = LayerNames("mlstm_layer", mixer_norm="norm_mlstm", ffn_norm="norm_ffn", ffns=("ffn",))
SINGLE_FFN = ((r"\.ffn\.proj_up_gate\.", ".ffn.gate_proj."), (r"\.ffn\.proj_up\.", ".ffn.up_proj."),
              (r"\.ffn\.proj_down\.", ".ffn.down_proj."))


def xlstm_sizes(raw: Mapping[str, Any]) -> dict[str, int]:
    """hidden, heads, q/k and v widths, FFN width, as transformers' xLSTM layers take them."""
    hidden = int(raw.get("hidden_size") or raw["embedding_dim"])
    multiple = int(raw.get("ffn_round_up_to_multiple_of", 64))
    ffn = float(raw.get("ffn_proj_factor", 2.667)) * hidden
    return dict(hidden=hidden, heads=int(raw.get("num_heads", 8)),
                qk=int(hidden * float(raw.get("qk_dim_factor", 0.5))),
                v=int(hidden * float(raw.get("v_dim_factor", 1.0))),
                ffn=int((ffn + multiple - 1) // multiple * multiple))


def check_supported(raw: Mapping[str, Any]) -> None:
    if raw.get("use_bias"):
        raise NotImplementedError("xlstm: use_bias=true is not supported (accepted: false)")
    if raw.get("norm_reduction_force_float32") is False:
        raise NotImplementedError("xlstm: norm_reduction_force_float32=false is not supported "
                                  "(accepted: true, norms reduce in float32)")
    if raw.get("weight_mode", "single") not in ("single", "fused"):
        raise ValueError(f"xlstm: weight_mode={raw['weight_mode']!r}; accepted: single, fused")


class XLstmForCausalLM(CausalLM):
    embed_name = "embeddings"
    norm_name = "out_norm"

    def __init__(self, config: Mapping[str, Any]) -> None:
        raw = config.get("text_config") or config
        check_supported(raw)
        size = xlstm_sizes(raw)
        eps = float(raw.get("norm_eps", 1e-6))
        cfg = dataclasses.replace(TextConfig.from_hf(config, eps=eps),
                                  final_logit_softcap=raw.get("output_logit_soft_cap", 30.0))
        fused = raw.get("weight_mode", "single") == "fused"
        cap = raw.get("gate_soft_cap", 15.0)
        super().__init__(cfg, (DecoderLayer(NAMES, MLstmLayer(
            size["hidden"], size["heads"], size["qk"], size["v"],
            eps=float(raw.get("eps", 1e-6)), norm_eps=eps,
            gate_soft_cap=None if cap is None else float(cap), layer=i),
            [GatedMLP(size["hidden"], size["ffn"], "silu",
                      fused=("proj_up_gate_z", "proj_down") if fused else None)],
            size["hidden"], eps) for i in range(cfg.num_layers)))
        self.sizes, self.fused = size, fused

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        s = self.sizes
        weights = renamed(weights, [(r"^(backbone|model)\.blocks\.", "model.layers.")])
        if self.fused:
            weights = split_rows(split_rows(weights, "qkv_opreact.", {
                "q.": s["qk"], "k.": s["qk"], "v.": s["v"], "ogate_preact.": s["v"]}),
                "ifgate_preact.", {"igate_preact.": s["heads"], "fgate_preact.": s["heads"]})
        else:
            weights = renamed(weights, SINGLE_FFN)
        super().load_weights(weights)
