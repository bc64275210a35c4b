"""The sparse indexers' models: dots3_note's layers as the planner sees them (MLA latents,
indexer keys, sliding MLA with per-layer sizes), Qwen4-Exp's, and both indexers' top-k when
every score ties: the selection then comes from the tie rule alone, and must still equal
transformers' under chunked prefill, prefix hits and preemption. The full engine matrix on
the random tiny models is in test_against_transformers.py."""

from __future__ import annotations

import pytest

from hybridkv.kv.plan import plan_kv_cache
from hybridkv.kv.spec import IndexerKeySpec, MLAAttentionSpec, MLASlidingWindowSpec
from hybridkv.models.layer_mix import kv_layout_from_config, layer_kinds

BASE = dict(model_type="dots3_note_text", hidden_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, head_dim=16, vocab_size=256,
            intermediate_size=128, sliding_window=16, q_lora_rank=24, kv_lora_rank=32,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, index_head_dim=16,
            index_n_heads=4, index_topk=8,
            layer_types=["indexed_attention", "indexed_attention", "sliding_attention",
                         "sliding_attention"],
            per_layer_config={"2": {"kv_lora_rank": 40}, "3": {"kv_lora_rank": 40}})


def test_indexed_layers_hold_latents_and_indexer_keys():
    assert layer_kinds(BASE) == [("mla", "indexer")] * 2 + [("mla_sliding",)] * 2
    specs = kv_layout_from_config(BASE, kv_dtype="float32").layer_specs
    latent = specs["model.layers.0.self_attn"]
    assert isinstance(latent, MLAAttentionSpec) and latent.head_size == 32 + 8
    keys = specs["model.layers.0.self_attn.indexer"]
    assert isinstance(keys, IndexerKeySpec)
    assert (keys.head_size, keys.page_size_bytes) == (16, 16 * 16 * 4)
    # Sliding layers: their own latent width (per_layer_config), no indexer.
    sliding = specs["model.layers.2.self_attn"]
    assert isinstance(sliding, MLASlidingWindowSpec)
    assert (sliding.head_size, sliding.sliding_window) == (40 + 8, 16)
    assert "model.layers.2.self_attn.indexer" not in specs


def test_layer_types_and_sliding_sizes_derived_as_transformers_derives_them():
    config = {k: v for k, v in BASE.items() if k not in ("layer_types", "per_layer_config")}
    config.update(num_hidden_layers=6, swa_kv_lora_rank=40, swa_qk_rope_head_dim=8)
    # Indexed: layers 0, 1 and every 4th from 1; the sliding layers' sizes from swa_*.
    assert [k[0] for k in layer_kinds(config)] == [
        "mla", "mla", "mla_sliding", "mla_sliding", "mla_sliding", "mla"]
    specs = kv_layout_from_config(config).layer_specs
    assert specs["model.layers.2.self_attn"].head_size == 40 + 8
    # use_dsa false: plain MLA, no indexer.
    assert layer_kinds(dict(config, use_dsa=False))[0] == ("mla",)
    with pytest.raises(ValueError, match="unknown dots3_note layer type 'mamba'"):
        layer_kinds(dict(BASE, layer_types=["mamba"] * 4))


def test_qwen4_exp_layers_hold_a_deltanet_state_or_kv_and_raw_indexer_keys():
    config = dict(model_type="qwen4_exp_text", hidden_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=16, indexer_n_heads=4, indexer_head_dim=16,
                  indexer_budget=8, indexer_compress_ratio=4)
    # No layer_types: attention every 4th layer; "full_attention" means indexed.
    assert layer_kinds(config) == [("linear_attention",)] * 3 + [("full", "indexer")]
    assert layer_kinds(dict(config, layer_types=["full_attention", "linear_attention"] * 2)
                       )[0] == ("full", "indexer")
    specs = kv_layout_from_config(config, kv_dtype="float32").layer_specs
    keys = specs["model.layers.3.self_attn.indexer"]
    assert isinstance(keys, IndexerKeySpec) and (keys.head_size, keys.compress_rate) == (16, 1)
    with pytest.raises(ValueError, match="unknown qwen4_exp layer type 'sliding_attention'"):
        layer_kinds(dict(config, layer_types=["sliding_attention"] * 4))


def test_plan_puts_indexer_keys_in_a_group_of_their_own():
    specs = kv_layout_from_config(BASE, kv_dtype="float32").layer_specs
    plan = plan_kv_cache(specs, 64 << 20, max_model_len=4096, max_num_batched_tokens=512)
    groups = {g.spec.kind: g for g in plan.config.groups}
    assert set(groups) == {"full", "indexer_key", "sliding_window"}
    assert groups["indexer_key"].layer_names == tuple(
        f"model.layers.{i}.self_attn.indexer" for i in (0, 1))
    assert groups["indexer_key"].block_bytes == 2 * 16 * 16 * 4
    assert plan.summary()["groups"][1]["dtype"] == "float32"
    # Hybrid management off: the window becomes a mask over latent pages; the indexer keys
    # stay a group of their own.
    off = plan_kv_cache(specs, 64 << 20, max_model_len=4096, max_num_batched_tokens=512,
                        hybrid=False)
    kinds = [(g.spec.kind, type(g.spec)) for g in off.config.groups]
    assert kinds == [("full", MLAAttentionSpec), ("indexer_key", IndexerKeySpec)]


def test_hybridkv_plan_reports_the_indexer_keys_per_group(tmp_path, capsys):
    import json

    from hybridkv.cli import main

    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, torch_dtype="bfloat16")))
    assert main(["plan", str(tmp_path), "--memory", "1GiB", "--json"]) == 0
    groups = {g["kind"]: g for g in json.loads(capsys.readouterr().out)["groups"]}
    # Two layers of 16 bf16 keys per token: 64 bytes a token, beside the latents.
    assert groups["indexer_key"]["bytes_per_token"] == 2 * 16 * 2
    assert groups["indexer_key"]["dtype"] == "bfloat16"
    assert groups["full"]["bytes_per_token"] == 2 * (32 + 8) * 2
    assert main(["plan", str(tmp_path), "--memory", "1GiB"]) == 0
    table = capsys.readouterr().out
    assert "indexer_key" in table and "sliding_window (MLA)" in table


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridkv import SamplingParams  # noqa: E402
from tests.models.test_against_transformers import (  # noqa: E402
    NUM_NEW,
    PROMPT_LENS,
    check,
    check_with_preemption,
    hf_reference,
    run,
)
from tests.models.tiny import build_tiny_model  # noqa: E402


def zero_dots3_keys(hf) -> None:
    # k_norm's scale and bias at zero: every indexer key, so every score, is 0.
    for layer in hf.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.k_norm.weight.zero_()
            layer.self_attn.indexer.k_norm.bias.zero_()


def zero_qwen4_keys(hf) -> None:
    # The block keys' norm scales by (1 + w): w = -1 makes every block key, so every
    # score, 0.
    for layer in hf.model.layers:
        if hasattr(layer, "self_attn"):
            layer.self_attn.indexer.k_layernorm.weight.fill_(-1.0)


def zero_v4_keys(hf) -> None:
    # DeepSeek-V4's CSA indexers: their key norms' scales at zero.
    for layer in hf.model.layers:
        indexer = getattr(layer.self_attn.compressor, "indexer", None)
        if indexer is not None:
            indexer.kv_norm.weight.zero_()


@pytest.fixture(scope="module", params=[("dots3_note", zero_dots3_keys),
                                        ("qwen4_exp", zero_qwen4_keys),
                                        ("deepseek_v4", zero_v4_keys)],
                ids=["dots3_note", "qwen4_exp", "deepseek_v4"])
def all_scores_tie(request, tmp_path_factory):
    """A tiny model whose indexers score every key 0: which positions a query reads is
    decided by ties alone."""
    name, zero_keys = request.param
    model_dir = build_tiny_model(name, tmp_path_factory.mktemp(f"{name}_ties"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        zero_keys(hf)
    hf.save_pretrained(model_dir)
    gen = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(4, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return (name, model_dir, prompts, *hf_reference(model_dir, prompts))


def test_ties_broken_as_transformers_breaks_them(all_scores_tie):
    _, model_dir, prompts, tokens, logits = all_scores_tie
    llm, outs = run(model_dir, prompts)
    check(llm, outs, tokens, logits)
    # Prompts split over chunks of 9: a query's row is the same (dots3_note: as long as the
    # prompt; Qwen4-Exp: its complete blocks; DeepSeek-V4: the whole prompt's entries).
    llm, outs = run(model_dir, prompts, max_num_batched_tokens=9)
    check(llm, outs, tokens, logits)
    llm, first = run(model_dir, prompts[:1])
    again = llm.generate(prompts[:1], SamplingParams(max_tokens=NUM_NEW))
    check(llm, again, tokens[:1], logits[:1])
    assert llm.engine.kv_manager.stats.num_hit_tokens == (len(prompts[0]) - 1) // 16 * 16


def test_ties_under_preemption(all_scores_tie):
    # Recomputed requests: their outputs' rows are what they were when generated
    # (dots3_note: p + 1 positions, not the length of prompt + outputs; DeepSeek-V4:
    # (p + 1) // rate entries).
    check_with_preemption(all_scores_tie)


@pytest.mark.parametrize("name", ["dots3_note", "qwen4_exp"])
def test_int8_pages_give_the_same_tokens_however_the_prompt_is_computed(name, tmp_path):
    # Quantized latents / K/V rows, gathered and dequantized per selected position: a
    # token's rows are the same bytes whether its prompt came in one chunk or many, from a
    # prefix hit or not.
    model_dir = build_tiny_model(name, tmp_path)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    base, outs = run(model_dir, prompts, kv_cache_dtype="int8", enable_prefix_caching=False)
    expected = [o.token_ids for o in outs]
    assert all(len(t) == NUM_NEW for t in expected)
    _, chunked = run(model_dir, prompts, kv_cache_dtype="int8", max_num_batched_tokens=9)
    assert [o.token_ids for o in chunked] == expected
    llm, _ = run(model_dir, prompts[:1], kv_cache_dtype="int8")
    again = llm.generate(prompts[:1], SamplingParams(max_tokens=NUM_NEW))
    assert again[0].token_ids == expected[0]
    assert llm.engine.kv_manager.stats.num_hit_tokens > 0
    dtypes = {g.spec.kind: g.spec.page_dtype for g in base.engine.plan.config.groups
              if g.spec.kind != "mamba"}
    # The indexer keys keep their own dtype: the KV cache dtype is the attention pages'.
    assert dtypes["full"] == "int8" and dtypes["indexer_key"] == "float32"


def test_q4_pages_on_qwen4_exp_are_refused_at_load(tmp_path):
    # Its query-sparse attention does not read q4's per-channel key groups: the engine says
    # so when it is built, not at a request's first step (which would fail the request).
    from hybridkv import LLM

    model_dir = build_tiny_model("qwen4_exp", tmp_path)
    with pytest.raises(ValueError, match="kv_cache_dtype 'q4': qwen4_exp's query-sparse"):
        LLM(str(model_dir), kv_cache_dtype="q4", kv_cache_memory="16MiB", max_model_len=128)
