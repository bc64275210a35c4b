"""Sliding + full attention families and the dense / MoE decoders of issue 16: their layer
mixes as the planner reads them, the shipped configs' plans, and the kit pieces they added
(SparseMixer routing, checkpoint renames and splits). Model outputs against transformers are
in test_against_transformers.py (tiny.py builds every family)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from hybridkv.cli import main
from hybridkv.models.config_check import check_config
from hybridkv.models.layer_mix import kv_layout_from_config, layer_kinds, load_hf_config

torch = pytest.importorskip("torch")


def kinds_of(config):
    return Counter(k for parts in layer_kinds(config) for k in parts)


@pytest.mark.parametrize("name, expected", [
    ("EXAONE-4.0-32B", {"sliding": 48, "full": 16}),           # sliding_window_pattern 4
    ("c4ai-command-a-03-2025", {"sliding": 48, "full": 16}),
    ("c4ai-command-r7b-12-2024", {"sliding": 24, "full": 8}),
    ("Trinity-Nano-Preview", {"sliding": 42, "full": 14}),    # global_attn_every_n_layers
    ("granite-swash-2b", {"sliding": 18, "full": 6}),
])
def test_layer_mix_and_plan_of_shipped_configs(name, expected, capsys):
    assert kinds_of(load_hf_config(name)) == Counter(expected)
    assert main(["plan", name, "--memory", "40GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["ideal_fraction"] >= 0.99
    # Sliding layers keep a window, not the whole context: several times the requests.
    assert plan["max_concurrency"] > 3 * plan["no_hybrid"]["max_concurrency"]


BASE = dict(num_hidden_layers=8, hidden_size=64, num_attention_heads=4, sliding_window=16)


def test_sliding_window_pattern_in_letters():
    kinds = layer_kinds({**BASE, "model_type": "exaone4", "sliding_window_pattern": "LLLG"})
    assert [k for (k,) in kinds] == (["sliding"] * 3 + ["full"]) * 2
    with pytest.raises(ValueError, match="sliding_window_pattern 'LLXG'"):
        layer_kinds({**BASE, "model_type": "exaone4", "sliding_window_pattern": "LLXG"})


@pytest.mark.parametrize("config_cls, extra", [
    ("Olmo3Config", {}), ("Cohere2Config", {}), ("Cohere2MoeConfig", {}), ("Exaone4Config", {}),
    ("ExaoneMoeConfig", {}), ("VaultGemmaConfig", {}),
    ("AfmoeConfig", {"global_attn_every_n_layers": 3}), ("GraniteSWAConfig", {}),
    ("GraniteMoeSWAConfig", {}), ("MiMoV2FlashConfig", {}),
    ("Dots1Config", {"max_window_layers": 5}), ("SmolLM3Config", {"use_sliding_window": True}),
    ("SmolLM3Config", {"use_sliding_window": False}), ("MinistralConfig", {}),
    *[(name, {"use_sliding_window": True, "max_window_layers": 5})
      for name in ("Qwen2Config", "Qwen3Config", "Qwen2MoeConfig")],
    ("Qwen3Config", {"use_sliding_window": True}),  # max_window_layers 28: all full
])
def test_configs_without_layer_types_get_the_family_default(config_cls, extra):
    """A config saved without `layer_types` (older checkpoints) gets the mix transformers
    builds for it."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, config_cls)(**BASE, num_key_value_heads=2, **extra).to_dict()
    expected = [("full",) if t == "full_attention" else ("sliding",)
                for t in config.pop("layer_types")]
    config.pop("sliding_window_pattern", None)
    assert layer_kinds(config) == expected


def test_a_zero_window_means_none_only_where_windows_are_off():
    # Qwen2-MoE's config writes sliding_window 0 when use_sliding_window is false.
    config = {**BASE, "model_type": "qwen2_moe", "sliding_window": 0,
              "use_sliding_window": False}
    check_config(config, "config.json", for_model=False)
    assert kinds_of(config) == Counter(full=8)
    assert len(kv_layout_from_config(config).layer_specs) == 8
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        check_config({**config, "use_sliding_window": True}, "config.json", for_model=False)


def test_sparsemixer_matches_transformers_routing():
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    from hybridkv.models.layers.sparsemixer import sparsemixer_top2

    gen = torch.Generator().manual_seed(0)
    for eps in (0.0, 0.01, 0.3, 10.0):
        logits = torch.randn(64, 8, generator=gen)
        ours_w, ours_ids = sparsemixer_top2(logits, eps)
        ref_w, ref_ids = sparsemixer(logits, eps, training=False, top_k=2)
        assert torch.equal(ours_ids, ref_ids)
        torch.testing.assert_close(ours_w, ref_w)
    # With no slack only the pick itself survives its mask: each weight is 1.
    weights, _ = sparsemixer_top2(torch.randn(5, 8, generator=gen), 0.0)
    assert torch.equal(weights, torch.ones(5, 2))


def test_checkpoint_renames_and_row_splits():
    from hybridkv.models.llama import MIXTRAL_NAMES
    from hybridkv.models.weights import renamed, split_rows

    t = torch.zeros(1)
    names = [n for n, _ in renamed([("model.layers.3.block_sparse_moe.experts.12.w1.weight", t),
                                    ("model.layers.3.block_sparse_moe.experts.12.w3.weight", t),
                                    ("model.layers.3.block_sparse_moe.experts.12.w2.weight", t),
                                    ("model.layers.3.block_sparse_moe.gate.weight", t)],
                                   MIXTRAL_NAMES)]
    assert names == ["model.layers.3.mlp.experts.12.gate_proj.weight",
                     "model.layers.3.mlp.experts.12.up_proj.weight",
                     "model.layers.3.mlp.experts.12.down_proj.weight",
                     "model.layers.3.mlp.gate.weight"]
    qkv = torch.arange(8.0).unsqueeze(1)
    parts = dict(split_rows([("l.qkv_proj.weight", qkv), ("l.o_proj.weight", t)], "qkv_proj.",
                            {"q_proj.": 4, "k_proj.": 2, "v_proj.": 2}))
    assert parts["l.q_proj.weight"].flatten().tolist() == [0, 1, 2, 3]
    assert parts["l.v_proj.weight"].flatten().tolist() == [6, 7]
    assert "l.o_proj.weight" in parts
    with pytest.raises(ValueError, match="has 8 rows; expected 9"):
        list(split_rows([("l.qkv_proj.weight", qkv)], "qkv_proj.",
                        {"q_proj.": 5, "k_proj.": 2, "v_proj.": 2}))


def test_sliding_layers_with_their_own_kv_head_count_get_their_own_group():
    """MiMo-V2-Flash: sliding layers have twice the KV heads of full layers and values
    narrower than keys (stored padded to the key size): one group per distinct spec, each
    with its own page size, planned near the ideal."""
    from hybridkv.kv.plan import plan_kv_cache

    config = {"model_type": "mimo_v2_flash", "num_hidden_layers": 12, "hidden_size": 256,
              "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 48,
              "v_head_dim": 32, "sliding_window": 512, "dtype": "bfloat16"}
    layout = kv_layout_from_config(config)
    plan = plan_kv_cache(layout.layer_specs, 1 << 30, max_model_len=32768,
                         max_num_batched_tokens=512)
    groups = {g.spec.kind: g for g in plan.config.groups}
    assert set(groups) == {"full", "sliding_window"}
    full, sliding = groups["full"].spec, groups["sliding_window"].spec
    # Layer 0 and 5, 11 full (every 6th and the first); the rest slide.
    assert len(groups["full"].layer_names) == 3 and len(groups["sliding_window"].layer_names) == 9
    assert (full.num_kv_heads, sliding.num_kv_heads) == (2, 4)
    assert full.head_size == sliding.head_size == 48
    assert plan.ideal_fraction >= 0.99


@pytest.mark.parametrize("config_cls", ["Starcoder2Config", "SmolLM3Config", "VaultGemmaConfig",
                                        "GraniteSWAConfig", "GraniteMoeSWAConfig", "Cohere2Config",
                                        "PhimoeConfig", "Qwen2Config"])
def test_an_unsaid_tie_follows_the_family_default(config_cls):
    """A config.json without `tie_word_embeddings` ties the lm_head as the family's
    transformers config class does by default."""
    transformers = pytest.importorskip("transformers")
    from hybridkv.models.registry import build_model

    reference = getattr(transformers, config_cls)(
        **BASE, num_key_value_heads=2, vocab_size=64, intermediate_size=32,
        num_local_experts=4)
    config = reference.to_dict()
    config.pop("tie_word_embeddings")
    model = build_model(config)
    assert (model.lm_head.weight is model.embed_tokens.weight) == \
        reference.tie_word_embeddings
