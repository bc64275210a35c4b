"""DeepSeek-V4-Flash's and V4-Pro's real configs (src/hybridkv/data/model_configs, sources in
SOURCES.md there) through the layer mix and the planner: the groups they make, and capacity
against the ideal bytes per token computed here from the config alone."""

from __future__ import annotations

import json
from collections import Counter
from importlib import resources
from typing import Any

import pytest

from hybridkv.cli import main
from hybridkv.kv.plan import plan_kv_cache
from hybridkv.models.layer_mix import (
    deepseek_v4_layer_types,
    deepseek_v4_rates,
    kv_layout_from_config,
)

MODELS = ("DeepSeek-V4-Flash", "DeepSeek-V4-Pro")


def config(name: str) -> dict[str, Any]:
    folder = resources.files("hybridkv") / "data" / "model_configs"
    return dict(json.loads((folder / f"deepseek-ai__{name}.json").read_text()))


def ideal_bytes(cfg: dict[str, Any], num_tokens: int) -> int:
    """What one request of `num_tokens` holds at least, from the config's numbers: every
    layer's K=V window of `sliding_window` rows of head_dim; per CSA layer (ratio 4) an entry
    of head_dim and an indexer key of index_head_dim per closed window of 4 tokens, and the
    compressor's state (the kv and gate rows of the last 3 tokens, 2 x width each, and the
    last window's first halves, 4 x width, for the compressor and its indexer's); per HCA
    layer (ratio 128) an entry per 128 tokens and the last 127 tokens' kv and gate rows."""
    assert cfg["torch_dtype"] == "bfloat16"
    size = 2
    head, index_head = cfg["head_dim"], cfg["index_head_dim"]
    ratios = cfg["compress_ratios"][:cfg["num_hidden_layers"]]
    total = len(ratios) * min(num_tokens, cfg["sliding_window"]) * head * size
    for ratio in ratios:
        if ratio == 4:
            total += num_tokens // 4 * (head + index_head) * size
            total += sum(2 * 3 * 2 * w + 2 * 4 * w for w in (head, index_head)) * size
        elif ratio == 128:
            total += num_tokens // 128 * head * size + 2 * 127 * head * size
        else:
            assert ratio == 0
    return total


@pytest.mark.parametrize("name", MODELS)
def test_layer_types_and_rates_are_transformers_own(name):
    transformers = pytest.importorskip("transformers")
    cfg = config(name)
    reference = transformers.DeepseekV4Config(**cfg)
    assert deepseek_v4_layer_types(cfg) == reference.layer_types
    assert deepseek_v4_rates(cfg) == reference.compress_rates


@pytest.mark.parametrize("name", MODELS)
def test_every_part_has_its_group(name):
    cfg = config(name)
    layout = kv_layout_from_config(cfg)
    ratios = Counter(cfg["compress_ratios"][:cfg["num_hidden_layers"]])
    kinds = Counter(spec.kind for spec in layout.layer_specs.values())
    assert kinds == {"sliding_window": cfg["num_hidden_layers"],
                     "compressed": ratios[4] + ratios[128], "indexer_key": ratios[4],
                     "compressor_state": ratios[4] + ratios[128]}
    plan = plan_kv_cache(layout.layer_specs, 80 << 30, max_model_len=131072,
                         max_num_batched_tokens=2048)
    groups = {(g["kind"], g["compress_rate"]): g["num_layers"]
              for g in plan.summary()["groups"]}  # type: ignore[union-attr]
    assert groups == {("sliding_window", None): cfg["num_hidden_layers"],
                      ("compressed", 4): ratios[4], ("indexer_key", 4): ratios[4],
                      ("compressor_state", 4): ratios[4], ("compressed", 128): ratios[128],
                      ("compressor_state", 128): ratios[128]}
    # Hits end where every group can resume: whole HCA windows.
    assert plan.config.hit_alignment == 128


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("num_tokens", [131072, 1 << 20])
@pytest.mark.parametrize("memory", [40 << 30, 80 << 30])
def test_plan_reaches_99_percent_of_the_ideal(name, num_tokens, memory):
    cfg = config(name)
    layout = kv_layout_from_config(cfg)
    plan = plan_kv_cache(layout.layer_specs, memory, max_model_len=num_tokens,
                         max_num_batched_tokens=2048)
    ideal = ideal_bytes(cfg, num_tokens)
    assert plan.ideal_bytes_per_token == ideal / num_tokens
    # Requests of num_tokens the budget would hold with no rounding, padding or reserve.
    assert plan.max_concurrency >= 0.99 * memory / ideal


def test_plan_prints_the_compressed_groups(capsys):
    assert main(["plan", "DeepSeek-V4-Pro", "--memory", "80GiB",
                 "--max-model-len", "1048576"]) == 0
    out = capsys.readouterr().out
    for label in ("sliding_window (MLA)", "compressed (1/4)", "compressed (1/128)",
                  "indexer_key (1/4)", "compressor_state (1/4)", "compressor_state (1/128)"):
        assert label in out
    ideal = ideal_bytes(config("DeepSeek-V4-Pro"), 1 << 20) / (1 << 20)
    assert f"ideal bytes / token   {ideal:,.1f}" in out
