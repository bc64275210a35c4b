"""Zamba2: the planner's view of its layer mix (a KV cache per use of the shared attention
block, Mamba2 state everywhere), the shipped Zamba2-7B plan, shared blocks only where
transformers ties them, and config variants refused. Outputs against transformers under
the full engine matrix are in test_against_transformers.py (tiny "zamba2")."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from hybridkv.cli import main
from hybridkv.models.layer_mix import kv_layout_from_config, layer_kinds, load_hf_config

TINY = dict(model_type="zamba2", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=256, intermediate_size=128, n_mamba_heads=8,
            mamba_d_state=16, mamba_ngroups=2,
            layers_block_type=["mamba", "hybrid", "linear_attention", "hybrid"])


def test_every_hybrid_layer_has_its_own_kv_cache_beside_its_mamba_state():
    assert layer_kinds(TINY) == [("mamba",), ("full", "mamba"), ("mamba",), ("full", "mamba")]
    specs = kv_layout_from_config(TINY).layer_specs
    assert sorted(n for n in specs if n.endswith("self_attn")) == [
        "model.layers.1.self_attn", "model.layers.3.self_attn"]
    # Heads over [h | embedding]: 2 x 64 / 4 = 32 wide.
    assert (specs["model.layers.1.self_attn"].num_kv_heads,
            specs["model.layers.1.self_attn"].head_size) == (4, 32)
    # conv over [x, B, C] = 128 + 2 x 2 x 16; SSM [8 heads, 128 / 8, 16].
    assert specs["model.layers.2.mamba"].shapes == ((192, 3), (8, 16, 16))


def test_zamba2_7b_plan(capsys):
    config = load_hf_config("Zamba2-7B")
    assert Counter(k for parts in layer_kinds(config) for k in parts) == \
        Counter({"mamba": 81, "full": 13})
    specs = kv_layout_from_config(config).layer_specs
    assert specs["model.layers.6.self_attn"].head_size == 224
    assert specs["model.layers.0.mamba"].shapes == ((7168 + 2 * 2 * 64, 3), (112, 64, 64))
    assert main(["plan", "Zamba2-7B", "--memory", "40GiB", "--max-model-len", "4096",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ideal_fraction"] >= 0.99


def test_layer_list_is_required_and_checked():
    without = {k: v for k, v in TINY.items() if k != "layers_block_type"}
    with pytest.raises(ValueError, match="layers_block_type .* is missing"):
        layer_kinds(without)
    with pytest.raises(ValueError, match="unknown zamba2 layer type 'attention'"):
        layer_kinds({**TINY, "layers_block_type": ["mamba", "attention", "mamba", "hybrid"]})


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybridkv.models.registry import build_model  # noqa: E402
from tests.models.test_against_transformers import check, hf_reference, run  # noqa: E402
from tests.models.tiny import build_tiny_model  # noqa: E402


def shared_blocks(model):
    return [layer.shared_transformer for layer in model.model.layers
            if hasattr(layer, "shared_transformer")]


def test_blocks_are_shared_only_where_transformers_ties_them():
    config = dict(TINY, num_hidden_layers=6, num_mem_blocks=2, layers_block_type=[
        "hybrid", "mamba", "hybrid", "hybrid", "mamba", "hybrid"])
    a, b, a2, b2 = shared_blocks(build_model(dict(config, tie_word_embeddings=True)))
    assert a2 is a and b2 is b and a is not b  # ABAB
    assert len({id(x) for x in shared_blocks(build_model(
        dict(config, tie_word_embeddings=False)))}) == 4


def test_untied_blocks_match_transformers(tmp_path):
    # Without tie_word_embeddings transformers ties nothing: each hybrid layer keeps and
    # runs its own copy of the block, and the checkpoint holds every copy.
    model_dir = build_tiny_model("zamba2", tmp_path, tie_word_embeddings=False)
    prompts = [list(range(5, 45)), list(range(60, 83))]
    tokens, logits = hf_reference(model_dir, prompts)
    llm, outs = run(model_dir, prompts, max_num_batched_tokens=9)
    check(llm, outs, tokens, logits)


def test_attention_adapters_need_as_many_kv_heads_as_heads():
    with pytest.raises(ValueError, match="use_shared_attention_adapter needs "
                                         "num_key_value_heads == num_attention_heads"):
        build_model(dict(TINY, num_key_value_heads=2, use_shared_attention_adapter=True))
