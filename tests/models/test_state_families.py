"""Linear-attention, SSM and short-convolution families of issue 16: their layer mixes and
state shapes as the planner reads them, the shipped configs' plans, and config spellings
(LFM2's `full_attn_idxs`, Falcon-Mamba's `expand` that disagrees with its saved width).
Model outputs against transformers are in test_against_transformers.py; state checkpoint
hits in test_state_prefix_caching.py."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from hybridkv.cli import main
from hybridkv.models.layer_mix import kv_layout_from_config, layer_kinds, load_hf_config


def kinds_of(config):
    return Counter(k for parts in layer_kinds(config) for k in parts)


@pytest.mark.parametrize("name, expected", [
    ("falcon-mamba-7b", {"mamba1": 64}),                       # no attention group at all
    ("LFM2-350M", {"conv": 10, "full": 6}),                    # full_attn_idxs
    ("LFM2-8B-A1B", {"conv": 18, "full": 6}),                  # layer_types
    ("Qwen3.5-0.8B", {"linear_attention": 18, "full": 6}),     # text_config inside qwen3_5
    ("MiniMax-M1-40k-hf", {"lightning": 70, "full": 10}),      # every 8th layer softmax
])
def test_layer_mix_and_plan_of_shipped_configs(name, expected, capsys):
    assert kinds_of(load_hf_config(name)) == Counter(expected)
    assert main(["plan", name, "--memory", "40GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["ideal_fraction"] >= 0.99


def test_state_shapes():
    falcon = kv_layout_from_config(load_hf_config("falcon-mamba-7b")).layer_specs
    # Inner width 8192 as saved (2 x hidden), not expand 16 x hidden: conv [8192, 3] and
    # SSM [8192, 16] per layer.
    assert falcon["model.layers.0.mamba"].shapes == ((8192, 3), (8192, 16))
    lfm2 = kv_layout_from_config(load_hf_config("LFM2-8B-A1B")).layer_specs
    # A short conv keeps its last L_cache - 1 = 2 inputs over the hidden channels, nothing
    # else; attention layers are plain full attention.
    assert lfm2["model.layers.0.mamba"].shapes == ((2048, 2),)
    assert lfm2["model.layers.2.self_attn"].kind == "full"


def test_pure_ssm_configs_need_no_attention_fields():
    base = dict(hidden_size=64, num_hidden_layers=3, state_size=16, conv_kernel=4)
    mamba2 = dict(base, model_type="mamba2", num_heads=8, head_dim=16, n_groups=2, expand=2)
    specs = kv_layout_from_config(mamba2).layer_specs
    # Mamba2: conv over [x, B, C] = 128 + 2 * 2 * 16 channels; SSM [heads, head_dim, state].
    assert specs["model.layers.0.mamba"].shapes == ((192, 3), (8, 16, 16))
    mamba = dict(base, model_type="mamba", expand=2)
    assert kinds_of(mamba) == Counter({"mamba1": 3})
    assert kv_layout_from_config(mamba).layer_specs["model.layers.2.mamba"].shapes == \
        ((128, 3), (128, 16))


def test_qwen3_5_text_config_inside_a_multimodal_config():
    text = dict(model_type="qwen3_5_text", hidden_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                layer_types=["linear_attention"] * 3 + ["full_attention"],
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_conv_kernel_dim=4)
    config = dict(model_type="qwen3_5", text_config=text)
    assert kinds_of(config) == Counter({"linear_attention": 3, "full": 1})
    spec = kv_layout_from_config(config).layer_specs["model.layers.0.mamba"]
    assert spec.shapes == ((2 * 2 * 16 + 4 * 16, 3), (4, 16, 16))


def test_qwen3_5_moe_loads_stacked_experts_as_released(tmp_path):
    """Released Qwen3.5-MoE checkpoints keep the experts stacked (`mlp.experts.gate_up_proj`,
    `mlp.experts.down_proj`) under `model.language_model.`; transformers writes one module
    per expert under `model.`. Both give the same tokens."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    from hybridkv import LLM, SamplingParams
    from tests.models.tiny import build_tiny_model

    per_expert = build_tiny_model("qwen3_5_moe_text", tmp_path / "per_expert")
    tensors = load_file(per_expert / "model.safetensors")
    stacked: dict[str, torch.Tensor] = {}
    for layer in range(4):
        prefix = f"model.layers.{layer}.mlp.experts"
        experts = range(4)
        stacked[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([
            tensors.pop(f"{prefix}.{e}.gate_proj.weight"),
            tensors.pop(f"{prefix}.{e}.up_proj.weight")]) for e in experts])
        stacked[f"{prefix}.down_proj"] = torch.stack(
            [tensors.pop(f"{prefix}.{e}.down_proj.weight") for e in experts])
    released = tmp_path / "released"
    released.mkdir()
    save_file({name.replace("model.", "model.language_model.", 1): t
               for name, t in {**tensors, **stacked}.items()},
              released / "model.safetensors")
    (released / "config.json").write_text((per_expert / "config.json").read_text())
    prompt = list(range(5, 40))
    outputs = [LLM(str(d), dtype="float32", max_model_len=64, kv_cache_memory="4MiB")
               .generate(prompt, SamplingParams(max_tokens=6))[0].token_ids
               for d in (per_expert, released)]
    assert outputs[0] == outputs[1]


def test_olmo_hybrid_defaults_and_plan(tmp_path, capsys):
    """OLMo Hybrid's transformers defaults where the config leaves fields out (Olmo-Hybrid-7B
    sizes): attention every 4th layer, 30 DeltaNet heads of key 96 (0.75 x hidden / heads)
    and value 192; conv over [q | k | v] = 2 x 30 x 96 + 30 x 192 channels."""
    config = dict(model_type="olmo_hybrid", hidden_size=3840, num_hidden_layers=32,
                  num_attention_heads=30, vocab_size=100352, intermediate_size=11008)
    assert kinds_of(config) == Counter({"linear_attention": 24, "full": 8})
    specs = kv_layout_from_config(config).layer_specs
    assert specs["model.layers.0.mamba"].shapes == ((2 * 30 * 96 + 30 * 192, 3), (30, 96, 192))
    assert specs["model.layers.3.self_attn"].kind == "full"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["plan", str(path), "--memory", "40GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ideal_fraction"] >= 0.99


@pytest.mark.parametrize("extra", [
    dict(rope_parameters={"rope_type": "default", "rope_theta": None}),  # released: NoPE
    dict(linear_allow_neg_eigval=False, rms_norm_eps=1e-3),  # beta in (0, 1)
])
def test_olmo_hybrid_variants_match_transformers(extra, tmp_path):
    """Variants the tiny model of the full matrix does not take: attention without RoPE, and
    beta not scaled by 2 (the gated output norm keeps eps 1e-5 whatever rms_norm_eps is)."""
    torch = pytest.importorskip("torch")
    from hybridkv import LLM, SamplingParams
    from tests.models.test_against_transformers import NUM_NEW, hf_reference
    from tests.models.tiny import build_tiny_model

    model_dir = build_tiny_model("olmo_hybrid", tmp_path, **extra)
    prompt = torch.randint(4, 256, (37,), generator=torch.Generator().manual_seed(5)).tolist()
    [ref_tokens], _ = hf_reference(model_dir, [prompt])
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, kv_cache_memory="4MiB",
              max_num_batched_tokens=9)
    assert llm.generate(prompt, SamplingParams(max_tokens=NUM_NEW))[0].token_ids == ref_tokens


@pytest.mark.parametrize("extra", [
    dict(rescale_every=1, layer_norm_epsilon=0.05),
    dict(rescale_every=0, layer_norm_epsilon=0.05),
])
def test_rwkv_rescaling_matches_transformers(extra, tmp_path):
    """transformers halves RWKV's hidden states after every `rescale_every`-th block at
    inference (and scales the output projections to match); only the LayerNorms' eps tells
    that apart from not rescaling, so a large eps and a halving after every block make it
    count. 0 switches it off."""
    torch = pytest.importorskip("torch")
    from hybridkv import LLM, SamplingParams
    from tests.hooks import record_logits
    from tests.models.test_against_transformers import NUM_NEW, hf_reference
    from tests.models.tiny import build_tiny_model

    model_dir = build_tiny_model("rwkv", tmp_path, **extra)
    prompt = torch.randint(4, 256, (37,), generator=torch.Generator().manual_seed(5)).tolist()
    [ref_tokens], [ref_logits] = hf_reference(model_dir, [prompt])
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, kv_cache_memory="4MiB",
              max_num_batched_tokens=9)
    llm.logits = record_logits(llm)
    [out] = llm.generate(prompt, SamplingParams(max_tokens=NUM_NEW))
    assert out.token_ids == ref_tokens
    torch.testing.assert_close(torch.stack(llm.logits.pop(out.request_id)), ref_logits,
                               atol=2e-4, rtol=1e-4)


def test_rwkv_state_and_plan(tmp_path, capsys):
    """RWKV-4 (RWKV/rwkv-4-169m-pile sizes; attention_hidden_size and intermediate_size left
    out, as transformers derives them): one state group, no attention; per layer the last
    inputs of time and channel mixing [2, 768] and the WKV numerator, denominator and max
    [3, 768] in float32."""
    config = dict(model_type="rwkv", hidden_size=768, num_hidden_layers=12, vocab_size=50277,
                  context_length=1024, torch_dtype="bfloat16")
    assert kinds_of(config) == Counter({"rwkv": 12})
    spec = kv_layout_from_config(config).layer_specs["model.layers.11.mamba"]
    assert spec.shapes == ((2, 768), (3, 768)) and spec.dtypes == ("bfloat16", "float32")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["plan", str(path), "--memory", "4GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["ideal_fraction"] >= 0.99 and len(plan["groups"]) == 1


def test_xlstm_state_and_plan(tmp_path, capsys):
    """xLSTM at xLSTM-7B's sizes (hidden 4096, 8 heads, q/k half as wide as v, no attention
    fields, no intermediate_size): one state group; per layer the memory [8, 256, 512] and
    [n | m] [8, 257], float32 (inference_state_dtype) whatever the weights' dtype."""
    config = dict(model_type="xlstm", hidden_size=4096, num_hidden_layers=32, num_heads=8,
                  vocab_size=50304, qk_dim_factor=0.5, v_dim_factor=1.0,
                  torch_dtype="bfloat16")
    assert kinds_of(config) == Counter({"mlstm": 32})
    spec = kv_layout_from_config(config).layer_specs["model.layers.31.mamba"]
    assert spec.shapes == ((8, 256, 512), (8, 257)) and spec.dtypes == ("float32", "float32")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["plan", str(path), "--memory", "40GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["ideal_fraction"] >= 0.99 and len(plan["groups"]) == 1


def test_xlstm_strong_caps_match_transformers(tmp_path):
    """Soft caps small enough to matter: gate pre-activations at 2, logits at 0.5."""
    torch = pytest.importorskip("torch")
    from hybridkv import LLM, SamplingParams
    from tests.hooks import record_logits
    from tests.models.test_against_transformers import NUM_NEW, hf_reference
    from tests.models.tiny import build_tiny_model

    model_dir = build_tiny_model("xlstm", tmp_path, gate_soft_cap=2.0,
                                 output_logit_soft_cap=0.5)
    prompt = torch.randint(4, 256, (37,), generator=torch.Generator().manual_seed(5)).tolist()
    [ref_tokens], [ref_logits] = hf_reference(model_dir, [prompt])
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, kv_cache_memory="4MiB",
              max_num_batched_tokens=9)
    llm.logits = record_logits(llm)
    [out] = llm.generate(prompt, SamplingParams(max_tokens=NUM_NEW))
    assert out.token_ids == ref_tokens
    torch.testing.assert_close(torch.stack(llm.logits.pop(out.request_id)), ref_logits,
                               atol=2e-4, rtol=1e-4)


def test_xlstm_loads_fused_weights(tmp_path):
    """weight_mode="fused" checkpoints hold [q | k | v | o], [i | f] (weights and biases)
    and the FFN's [gate | up] each in one tensor (transformers 5.23 cannot build such a model
    from scratch: its initialiser fails, so the fused copy is made from a single one): same
    tokens as the single-tensor checkpoint."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    from hybridkv import LLM, SamplingParams
    from tests.models.tiny import build_tiny_model

    single = build_tiny_model("xlstm", tmp_path / "single")
    tensors = load_file(single / "model.safetensors")
    for layer in range(3):
        mlstm, ffn = f"backbone.blocks.{layer}.mlstm_layer.", f"backbone.blocks.{layer}.ffn."
        tensors[mlstm + "qkv_opreact.weight"] = torch.cat([tensors.pop(
            f"{mlstm}{part}.weight") for part in ("q", "k", "v", "ogate_preact")])
        for kind in ("weight", "bias"):
            tensors[f"{mlstm}ifgate_preact.{kind}"] = torch.cat([tensors.pop(
                f"{mlstm}{gate}_preact.{kind}") for gate in ("igate", "fgate")])
        tensors[ffn + "proj_up_gate_z.weight"] = torch.cat([
            tensors.pop(ffn + "proj_up_gate.weight"), tensors.pop(ffn + "proj_up.weight")])
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file(tensors, fused / "model.safetensors")
    config = json.loads((single / "config.json").read_text())
    (fused / "config.json").write_text(json.dumps({**config, "weight_mode": "fused"}))
    prompt = list(range(5, 40))
    outputs = [LLM(str(d), dtype="float32", max_model_len=64, kv_cache_memory="4MiB")
               .generate(prompt, SamplingParams(max_tokens=6))[0].token_ids
               for d in (single, fused)]
    assert outputs[0] == outputs[1]


def test_xlstm_refuses_what_it_does_not_run():
    pytest.importorskip("torch")
    from hybridkv.models.registry import build_model

    config = dict(model_type="xlstm", hidden_size=128, num_hidden_layers=1, num_heads=4,
                  vocab_size=256)
    with pytest.raises(NotImplementedError, match="use_bias"):
        build_model(dict(config, use_bias=True))
    with pytest.raises(ValueError, match="weight_mode"):
        build_model(dict(config, weight_mode="other"))
