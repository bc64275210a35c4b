"""Gemma 4's values-equal-keys layers on K-only pages: the planner gives them half the bytes,
the engine's KV view holds raw keys only, and outputs stay equal to transformers. (The tiny
gemma4_text of tests/models/tiny.py runs them under the full matrix in
test_against_transformers.py; here a Gemma 4 unified variant with two KV heads per K-only
layer, one of them read by a KV-sharing layer.)"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridkv import SamplingParams  # noqa: E402
from hybridkv.cli import main  # noqa: E402
from hybridkv.kv.spec import AttentionSpec  # noqa: E402
from hybridkv.models.layer_mix import kv_layout_from_config, load_hf_config  # noqa: E402
from tests.models.test_against_transformers import check, hf_reference, run  # noqa: E402
from tests.models.tiny import build_tiny_model  # noqa: E402

K_ONLY = dict(attention_k_eq_v=True, num_global_key_value_heads=2)


def test_layer_mix_gives_values_equal_keys_layers_k_only_pages():
    config = transformers.Gemma4TextConfig(**K_ONLY, num_hidden_layers=30).to_dict()
    # transformers saves per_layer_config keyed "05", "11", ...: those layers are 512 wide.
    assert "05" in config["per_layer_config"]
    specs = kv_layout_from_config(config).layer_specs
    full, sliding = specs["model.layers.5.self_attn"], specs["model.layers.4.self_attn"]
    assert isinstance(full, AttentionSpec) and isinstance(sliding, AttentionSpec)
    assert (full.num_kv_heads, full.head_size, full.keys_only) == (2, 512, True)
    assert (sliding.num_kv_heads, sliding.head_size, sliding.keys_only) == (4, 256, False)
    assert full.bytes_per_token == 2 * 512 * 2  # raw keys only, bf16
    plain = transformers.Gemma4TextConfig(num_hidden_layers=30).to_dict()
    assert not kv_layout_from_config(plain).layer_specs["model.layers.5.self_attn"].keys_only


def test_plan_table_marks_k_only_groups(tmp_path, capsys):
    model_dir = build_tiny_model("gemma4_text", tmp_path)
    assert main(["plan", str(model_dir), "--memory", "64MiB", "--max-model-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "full (K-only)" in out and "sliding_window" in out
    assert main(["plan", str(model_dir), "--memory", "64MiB", "--max-model-len", "256",
                 "--no-hybrid"]) == 0
    assert "full (1 K-only)" in capsys.readouterr().out  # 3 sliding + 1 full layer


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    model_dir = build_tiny_model("gemma4_unified_text", tmp_path_factory.mktemp("g4u"),
                                 **K_ONLY)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, 256, (n,), generator=gen).tolist() for n in (40, 23, 7)]
    return model_dir, prompts, *hf_reference(model_dir, prompts)


def test_k_only_pages_hold_raw_keys_and_equal_transformers(reference):
    model_dir, prompts, tokens, logits = reference
    llm, outs = run(model_dir, prompts)
    check(llm, outs, tokens, logits)
    spec = kv_layout_from_config(load_hf_config(str(model_dir))).layer_specs
    assert spec["model.layers.2.self_attn"].keys_only  # type: ignore[attr-defined]
    views = llm.engine.runner.kv_caches
    full, shared = views["model.layers.2.self_attn"], views["model.layers.5.self_attn"]
    assert full.shape[2:] == (16, 2, 32) and shared is full  # [pages, per_page, block, Hk, D]
    assert views["model.layers.0.self_attn"].shape[2:] == (2, 16, 2, 16)
    again = llm.generate(prompts[:1], SamplingParams(max_tokens=16))
    check(llm, again, tokens[:1], logits[:1])
    assert llm.engine.kv_manager.stats.num_hit_tokens > 0


@pytest.mark.parametrize("options", [
    dict(disable_hybrid_kv_cache=True), dict(block_size=16, kernel_block_size=4),
    dict(max_num_batched_tokens=9), dict(kv_sharing_fast_prefill=True)])
def test_k_only_pages_under_engine_settings(reference, options):
    model_dir, prompts, tokens, logits = reference
    llm, outs = run(model_dir, prompts, **options)
    check(llm, outs, tokens, logits)
