"""The planner's view of the sliding + full decoders whose pages or states differ from plain
attention (Zaya's CCA state beside each layer's KV, Doge's key-bias channel, ModernBERT-
Decoder's ungrouped KV heads), and the config variants those families refuse. Outputs
against transformers under the full engine matrix are in test_against_transformers.py."""

from __future__ import annotations

import pytest

from hybridkv.models.layer_mix import kv_layout_from_config, layer_kinds

BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=256, intermediate_size=128, sliding_window=16)


def test_zaya_layers_hold_a_kv_cache_and_a_cca_state():
    config = dict(BASE, model_type="zaya", layer_types=["hybrid_sliding", "hybrid"],
                  cca_time0=2, cca_time1=3)
    assert layer_kinds(config) == [("sliding", "cca"), ("full", "cca")]
    specs = kv_layout_from_config(config).layer_specs
    assert specs["model.layers.0.self_attn"].kind == "sliding_window"
    assert specs["model.layers.1.self_attn"].kind == "full"
    # The convs' last (2 - 1) + (3 - 1) inputs over [q | k] = (4 + 2) x 16 channels, and the
    # delayed half of the values (2 x 16 / 2).
    assert specs["model.layers.0.mamba"].shapes == ((96, 3), (16,))
    with pytest.raises(ValueError, match="unknown zaya layer type 'mamba'"):
        layer_kinds(dict(config, layer_types=["mamba", "hybrid"]))


def test_doge_pages_carry_one_more_key_channel():
    spec = kv_layout_from_config(dict(BASE, model_type="doge")).layer_specs[
        "model.layers.0.self_attn"]
    assert (spec.num_kv_heads, spec.head_size) == (2, 17)


def test_modernbert_decoder_has_as_many_kv_heads_as_query_heads():
    # Its attention reads neither num_key_value_heads nor head_dim.
    spec = kv_layout_from_config(dict(
        BASE, model_type="modernbert-decoder", layer_types=["full_attention",
                                                           "sliding_attention"])
    ).layer_specs["model.layers.1.self_attn"]
    assert (spec.num_kv_heads, spec.head_size) == (4, 16)


def test_modernbert_decoder_window_is_half_of_local_attention():
    # Configs written before `sliding_window` was saved: the window and the layer rule
    # (a full layer every `global_attn_every_n_layers`) as transformers derives them.
    config = dict(BASE, model_type="modernbert-decoder", num_hidden_layers=4,
                  local_attention=32, global_attn_every_n_layers=2)
    del config["sliding_window"]
    specs = kv_layout_from_config(config).layer_specs
    assert [specs[f"model.layers.{i}.self_attn"].kind for i in range(4)] == [
        "full", "sliding_window"] * 2
    assert specs["model.layers.1.self_attn"].sliding_window == 16


def test_refused_variants_say_what_is_supported():
    pytest.importorskip("torch")
    from hybridkv.models.registry import build_model

    with pytest.raises(NotImplementedError, match="is_moe"):
        build_model(dict(BASE, model_type="doge", is_moe=True))
    with pytest.raises(ValueError, match="gating='per-token'"):
        build_model(dict(BASE, model_type="laguna", gating="per-token",
                         layer_types=["sliding_attention", "full_attention"],
                         mlp_layer_types=["dense", "dense"]))


def test_doge_refuses_positions_past_keep_window_size(tmp_path):
    pytest.importorskip("transformers")
    from hybridkv import LLM, SamplingParams
    from tests.models.tiny import build_tiny_model

    # Full attention: past 24 visible keys Doge would select keys dynamically.
    model_dir = build_tiny_model("doge", tmp_path, sliding_window=None, keep_window_size=24)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=64, kv_cache_memory="4MiB")
    assert llm.generate([[5] * 20], SamplingParams(max_tokens=4))[0].token_ids
    # The request fails with the reason; the engine goes on.
    out = llm.generate([[5] * 30], SamplingParams(max_tokens=4))[0]
    assert out.finish_reason == "error" and "keep_window_size=24" in out.error
    assert llm.generate([[6] * 20], SamplingParams(max_tokens=4))[0].finish_reason == "length"
