"""DeepSeek-V3-style MoE blocks (grouped sigmoid routing with a correction bias, plus shared
experts; layers/grouped_topk.py) built from the config spellings Kimi Linear and Ling 3.0
save: transformers writes their attribute-mapped names (`num_experts_per_token`,
`num_expert_group`, `moe_renormalize`, `num_shared_experts`), older configs the plain ones."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.layers.grouped_topk import GroupedTopKRouter, SharedExpertsMoE
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.moe import ExpertMLPs


def routed_moe(raw: Mapping[str, Any], hidden: int, act: str) -> SharedExpertsMoE:
    num_experts = int(_first(raw, "num_experts", "num_local_experts"))
    size = int(_first(raw, "moe_intermediate_size"))
    gate = GroupedTopKRouter(
        hidden, num_experts, int(_first(raw, "num_experts_per_token", "num_experts_per_tok")),
        num_groups=int(_first(raw, "num_expert_group", "n_group", default=1)),
        topk_groups=int(_first(raw, "topk_group", default=1)),
        renormalize=bool(_first(raw, "moe_renormalize", "norm_topk_prob", default=True)),
        scale=float(_first(raw, "routed_scaling_factor", default=1.0)))
    shared = int(_first(raw, "num_shared_experts", "n_shared_experts", default=1))
    return SharedExpertsMoE(hidden, gate, ExpertMLPs(num_experts, hidden, size, act),
                            GatedMLP(hidden, size * shared, act) if shared else None)


def is_sparse(raw: Mapping[str, Any], layer: int, *, first_dense: int) -> bool:
    """Routed experts on this layer: `mlp_layer_types` ("dense" / "sparse"), else every
    layer from `first_k_dense_replace` (`first_dense`: the family's default) on."""
    types = raw.get("mlp_layer_types")
    if types:
        return bool(types[layer] == "sparse")
    return layer >= int(_first(raw, "first_k_dense_replace", default=first_dense))


def _first(cfg: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    if default is None:
        raise ValueError(f"config.json: {names[0]} is missing")
    return default
