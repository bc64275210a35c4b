"""Zamba2 and Zamba: the planner's view of their layer mix (a KV cache per use of the shared
attention block, Mamba2 / Mamba1 state everywhere), the shipped Zamba2-7B plan, shared blocks
only where transformers ties them, and config variants refused. Outputs against transformers
under the full engine matrix are in test_against_transformers.py (tiny "zamba2", "zamba")."""

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


def test_zamba_state_is_mamba1_and_attention_heads_follow_attention_head_dim():
    zamba = dict(TINY, model_type="zamba", n_mamba_heads=2, attention_head_dim=16)
    assert layer_kinds(zamba)[1] == ("full", "mamba1")
    specs = kv_layout_from_config(zamba).layer_specs
    # Mamba1 per channel, all heads together: conv [128, 3], SSM [128, 16].
    assert specs["model.layers.0.mamba"].shapes == ((128, 3), (128, 16))
    assert specs["model.layers.3.self_attn"].head_size == 16


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from hybridkv.models.formats.loader import load_model  # noqa: E402
from hybridkv.models.registry import build_model  # noqa: E402
from tests.models.test_against_transformers import check, hf_reference, run  # noqa: E402
from tests.models.tiny import build_tiny_model  # noqa: E402


def shared_blocks(model, name="shared_transformer"):
    return [getattr(layer, name) for layer in model.model.layers if hasattr(layer, name)]


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


def test_zamba_layers_without_a_list_are_where_transformers_puts_them():
    fields = dict(num_hidden_layers=15, attn_layer_period=6, attn_layer_offset=4)
    words = transformers.ZambaConfig(**fields).layers_block_type
    assert [i for i, w in enumerate(words) if w == "hybrid"] == [2, 7, 13]
    config = dict(TINY, model_type="zamba", layers_block_type=None, **fields)
    assert [i for i, k in enumerate(layer_kinds(config)) if "full" in k] == [2, 7, 13]


def test_zamba_has_one_block_shared_by_every_use_when_tied():
    config = dict(TINY, model_type="zamba", n_mamba_heads=2, tie_word_embeddings=True)
    first, second = shared_blocks(build_model(config), "shared_transf")
    assert first is second


def with_own_copy_of_block_a(model_dir, noise):
    """Rewrite the checkpoint with a copy of layer 1's block (A) for layer 4, its later
    use: `noise` 0 gives the same values."""
    path = model_dir / "model.safetensors"
    weights = load_file(path)
    gen = torch.Generator().manual_seed(2)
    for name in [n for n in weights if n.startswith("model.layers.1.shared_transformer.")]:
        tensor = weights[name]
        weights[name.replace("layers.1.", "layers.4.")] = \
            tensor + noise * torch.randn(tensor.shape, generator=gen)
    save_file(weights, path, metadata={"format": "pt"})


def test_a_later_use_runs_its_own_copy_where_a_tied_checkpoint_has_other_values(tmp_path):
    model_dir = build_tiny_model("zamba2", tmp_path)
    with_own_copy_of_block_a(model_dir, 0.1)
    prompts = [list(range(5, 45)), list(range(60, 83))]
    tokens, logits = hf_reference(model_dir, prompts)  # transformers does not tie them then
    llm, outs = run(model_dir, prompts)
    check(llm, outs, tokens, logits)
    a, b, a2 = shared_blocks(llm.engine.runner.model)
    assert a2 is not a and b is not a


def test_a_copy_with_the_same_values_stays_tied(tmp_path):
    model_dir = build_tiny_model("zamba2", tmp_path)
    with_own_copy_of_block_a(model_dir, 0.0)
    a, _, a2 = shared_blocks(load_model(model_dir, dtype=torch.float32, device="cpu").model)
    assert a2 is a


def test_attention_adapters_need_as_many_kv_heads_as_heads():
    with pytest.raises(ValueError, match="use_shared_attention_adapter needs "
                                         "num_key_value_heads == num_attention_heads"):
        build_model(dict(TINY, num_key_value_heads=2, use_shared_attention_adapter=True))
