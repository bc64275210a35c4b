import json
from collections import Counter

import pytest

from hybridkv.models.layer_mix import (
    kv_layout_from_config,
    layer_kinds,
    load_hf_config,
    shipped_config_names,
)


def kinds_of(name):
    return Counter(k for parts in layer_kinds(load_hf_config(name)) for k in parts)


@pytest.mark.parametrize("name, expected", [
    ("gemma-3-27b-it", {"sliding": 52, "full": 10}),       # default pattern 6
    ("gemma-3-1b-it", {"sliding": 22, "full": 4}),         # sliding_window_pattern
    ("gemma-3-270m", {"sliding": 15, "full": 3}),          # layer_types
    ("gemma-2-9b", {"sliding": 21, "full": 21}),
    ("gpt-oss-20b", {"sliding": 12, "full": 12}),
    ("gpt-oss-120b", {"sliding": 18, "full": 18}),
    ("Llama-4-Scout-17B-16E-Instruct", {"chunked": 36, "full": 12}),  # NoPE every 4th
    ("Mistral-7B-v0.1", {"sliding": 32}),
    ("Qwen3-8B", {"full": 36}),                            # use_sliding_window false
    ("Llama-3.1-8B", {"full": 32}),
    ("SmolLM3-3B", {"full": 36}),                          # NoPE layers hold full KV too
    ("Qwen3-Next-80B-A3B-Instruct", {"linear_attention": 36, "full": 12}),
    ("AI21-Jamba-1.5-Mini", {"mamba1": 28, "full": 4}),    # attn_layer_period / offset
    ("granite-4.0-h-tiny", {"mamba": 36, "full": 4}),
    ("Nemotron-H-8B-Base-8K", {"mamba": 24, "full": 4}),  # hybrid_override_pattern
    ("NVIDIA-Nemotron-Nano-9B-v2", {"mamba": 27, "full": 4}),
    ("Falcon-H1-7B-Instruct", {"mamba": 44, "full": 44}),  # parallel attention + Mamba2
    ("gemma-3n-E4B-it", {"sliding": 28, "full": 7}),
])
def test_layer_mix_of_shipped_configs(name, expected):
    assert kinds_of(name) == Counter(expected)


def test_every_shipped_config_is_plannable():
    for name in shipped_config_names():
        layout = kv_layout_from_config(load_hf_config(name))
        assert layout.layer_specs, name


def test_older_field_spellings():
    base = dict(model_type="jamba", num_hidden_layers=4, hidden_size=64,
                num_attention_heads=4, num_key_value_heads=2)
    assert layer_kinds({**base, "layers_block_type": ["mamba", "attention", "mamba", "mlp"]}) \
        == [("mamba1",), ("full",), ("mamba1",), ()]
    assert layer_kinds({**base, "model_type": "bamba", "attn_layer_indices": [1, 3]}) \
        == [("mamba",), ("full",), ("mamba",), ("full",)]
    qwen = {**base, "model_type": "qwen2", "sliding_window": 32, "use_sliding_window": True,
            "max_window_layers": 2}
    assert layer_kinds(qwen) == [("full",), ("full",), ("sliding",), ("sliding",)]


def test_mamba2_state_shapes_follow_the_config():
    layout = kv_layout_from_config(load_hf_config("Nemotron-H-8B-Base-8K"))
    spec = layout.layer_specs["model.layers.0.mamba"]
    # conv over [x, B, C]: 128*64 + 2*8*128 channels, kernel 4 - 1; SSM [128, 64, 128]
    assert spec.shapes == ((128 * 64 + 2 * 8 * 128, 3), (128, 64, 128))


def test_kv_sharing_targets_the_last_earlier_layer_of_the_same_type():
    layout = kv_layout_from_config(load_hf_config("gemma-3n-E4B-it"))
    assert len(layout.kv_sharing) == 15
    assert layout.kv_sharing["model.layers.20.self_attn"] == "model.layers.18.self_attn"
    assert layout.kv_sharing["model.layers.24.self_attn"] == "model.layers.19.self_attn"


def test_model_directory_and_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
         "num_attention_heads": 4}))
    assert load_hf_config(str(tmp_path))["model_type"] == "llama"
    with pytest.raises(ValueError, match="unknown architecture model_type='bert'"):
        kv_layout_from_config({"model_type": "bert", "num_hidden_layers": 1})
    with pytest.raises(ValueError, match="neither a model directory"):
        load_hf_config(str(tmp_path / "missing"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_hf_config(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="unknown layer type 'foo'"):
        layer_kinds({"model_type": "llama", "num_hidden_layers": 1, "layer_types": ["foo"]})


def test_transformers_5_spelling_of_mamba_layers():
    # transformers 5.x saves NemotronH's mix as layers_block_type with "linear_attention".
    config = {"model_type": "nemotron_h", "num_hidden_layers": 3, "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "layers_block_type": ["linear_attention", "full_attention", "mlp"],
              "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2,
              "conv_kernel": 4}
    assert layer_kinds(config) == [("mamba",), ("full",), ()]
    spec = kv_layout_from_config(config).layer_specs["model.layers.0.mamba"]
    assert spec.shapes == ((8 * 16 + 2 * 2 * 16, 3), (8, 16, 16))


def test_kimi_linear_keeps_one_latent_per_token_and_kda_states():
    # Released configs list the MLA layers 1-indexed in linear_attn_config.full_attn_layers.
    assert kinds_of("Kimi-Linear-48B-A3B-Instruct") == Counter({"kda": 20, "mla": 7})
    layout = kv_layout_from_config(load_hf_config("Kimi-Linear-48B-A3B-Instruct"))
    mla = layout.layer_specs["model.layers.3.self_attn"]
    # kv_lora_rank 512 + qk_rope_head_dim 64, bf16: 1,152 bytes per token, no V (K/V of 32
    # heads of 192 + 128 would be 20,480).
    assert (mla.num_kv_heads, mla.head_size, mla.page_size_bytes) == (1, 576, 16 * 1152)
    kda = layout.layer_specs["model.layers.0.mamba"]
    # conv over [q, k, v] of 32 heads of 128, kernel 4 - 1; the state in float32
    assert kda.shapes == ((3 * 32 * 128, 3), (32, 128, 128))
    assert kda.dtypes == ("bfloat16", "float32")


def test_ling_layers_follow_layer_group_size_and_its_kda_uses_the_attention_fields():
    # Ling 3.0 configs give no layer list: MLA closes every group of `layer_group_size`;
    # KDA layers take the attention heads, head_dim and short_conv_kernel_size.
    cfg = dict(model_type="bailing_hybrid", num_hidden_layers=12, hidden_size=2560,
               num_attention_heads=32, num_key_value_heads=32, head_dim=128,
               kv_lora_rank=512, qk_rope_head_dim=64, short_conv_kernel_size=4,
               layer_group_size=6)
    assert [parts[0] for parts in layer_kinds(cfg)] == (["kda"] * 5 + ["mla"]) * 2
    layout = kv_layout_from_config(cfg)
    assert layout.layer_specs["model.layers.5.self_attn"].head_size == 576
    assert layout.layer_specs["model.layers.0.mamba"].shapes == ((3 * 32 * 128, 3),
                                                                 (32, 128, 128))
