"""Quantized KV pages in the planner (no torch): the rule that picks each group's dtype, the
page sizes it gives, and the capacity `hybridkv plan` reports, hybrid models included (a state
group's large page must not eat the attention groups' gain)."""

from __future__ import annotations

import json

import pytest

from hybridkv.cli import main
from hybridkv.kv.cache_dtype import apply_cache_dtype
from hybridkv.kv.plan import plan_kv_cache
from hybridkv.kv.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from hybridkv.models.layer_mix import kv_layout_from_config, load_hf_config


def layout(name: str, dtype: str = "float32"):
    return kv_layout_from_config(load_hf_config(name), kv_dtype=dtype)


def plan(name: str, kv_cache_dtype: str = "auto", skip=None, state_dtype="auto",
         max_model_len: int = 32768):
    lay = layout(name)
    specs = apply_cache_dtype(lay.layer_specs, kv_cache_dtype, skip, state_dtype)
    return plan_kv_cache(specs, 40 << 30, max_model_len=max_model_len,
                         max_num_batched_tokens=2048, kv_sharing=lay.kv_sharing)


def test_page_bytes_include_the_scales():
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="float32",
                             cache_dtype="int8")
    # K and V, 8 heads, a row of 128 int8 values and 4 fp16 scales.
    assert spec.bytes_per_token == 2 * 8 * (128 + 8)
    assert spec.page_size_bytes == 16 * spec.bytes_per_token
    q4 = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="float32",
                           cache_dtype="q4")
    # K: 64 bytes of nibbles + a 32-byte share of its group's per-channel (scale, minimum)
    # pairs; V: 4 fp16 scales and 64 bytes of nibbles; both rows (64 + 32 + 8 + 64) / 2.
    assert q4.bytes_per_token == 2 * 8 * 84
    odd = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=65, dtype="float32",
                            cache_dtype="int8")
    assert odd.row_bytes == 72  # 3 scales, 65 values, 1 byte of padding keeps rows aligned


def test_groups_of_other_dtypes_never_merge():
    a = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=64, sliding_window=32)
    b = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=64, sliding_window=32,
                          cache_dtype="int8")
    assert a.group_key() != b.group_key()


@pytest.mark.parametrize("dtype, least", [("int8", 3.5), ("q4", 6.0)])
def test_attention_capacity_gain_on_a_float32_model(dtype, least):
    base = plan("Llama-3.1-8B")
    ours = plan("Llama-3.1-8B", dtype)
    assert ours.capacity_tokens / base.capacity_tokens >= least


@pytest.mark.parametrize("name", ["Nemotron-H-8B-Base-8K", "Qwen3.5-0.8B",
                                  "NVIDIA-Nemotron-Nano-9B-v2"])
@pytest.mark.parametrize("dtype", ["int8", "q4"])
def test_a_hybrid_model_keeps_its_ideal_gain(name, dtype):
    """Concurrent 32K requests grow by at least 97% of what the bytes per request allow
    (quantized attention bytes + the unchanged state bytes): no page-size pinning."""
    base, ours = plan(name), plan(name, dtype)
    ideal = base.ideal_bytes_per_token / ours.ideal_bytes_per_token
    assert ideal > 1.5
    assert ours.max_concurrency / base.max_concurrency >= 0.97 * ideal


def test_skip_keeps_the_sliding_groups_in_the_model_dtype():
    ours = plan("gemma-3-27b-it", "int8", skip="sliding")
    kinds = {g.spec.kind: g.spec for g in ours.config.groups}
    assert kinds["sliding_window"].cache_dtype is None
    assert kinds["full"].cache_dtype == "int8"


def test_state_dtype_changes_only_the_states():
    specs = apply_cache_dtype(layout("Nemotron-H-8B-Base-8K").layer_specs, "int8",
                              state_dtype="bf16")
    states = [s for s in specs.values() if isinstance(s, MambaSpec)]
    assert states and all(set(s.dtypes) == {"bf16"} for s in states)


@pytest.mark.parametrize("args, says", [
    (("auto", "sliding"), "needs a quantized kv_cache_dtype"),
    (("int8", "sliding"), "names no layer of this model"),
    (("int8", "windowed"), "unknown kv_cache_dtype_skip kind 'windowed'"),
    (("int4", None), "unknown kv_cache_dtype 'int4'; accepted: auto, int8, q4, fp8"),
    # Rules that would change nothing.
    (("int8", "full"), r"kv_cache_dtype_skip \(--kv-cache-dtype-skip\) 'full' keeps every "
     r"attention layer of this model \(full\) in the model's dtype, so kv_cache_dtype "
     r"'int8' would quantize nothing; skip fewer kinds, or leave kv_cache_dtype 'auto'"),
    (("auto", None, "bf16"), r"state_dtype \(--state-dtype\) 'bf16' sets the dtype of "
     r"recurrent states \(Mamba, linear attention\), and this model has none \(its "
     r"layers: full\); leave it 'auto'"),
])
def test_bad_rules_are_one_line(args, says):
    with pytest.raises(ValueError, match=says):
        apply_cache_dtype(layout("Llama-3.1-8B").layer_specs, *args)


def test_a_kv_cache_dtype_on_a_model_without_attention_is_refused():
    with pytest.raises(ValueError, match=r"'int8' quantizes attention pages, and this model "
                                         r"has no attention layer \(its layers: mamba\); "
                                         r"leave it 'auto'; state_dtype sets"):
        apply_cache_dtype(layout("falcon-mamba-7b").layer_specs, "int8")
    # What does apply there: the states' dtype.
    specs = apply_cache_dtype(layout("falcon-mamba-7b").layer_specs, state_dtype="bf16")
    assert all(set(s.dtypes) == {"bf16"} for s in specs.values() if isinstance(s, MambaSpec))


def test_plan_json_reports_each_groups_dtype_and_bytes_per_token(capsys):
    assert main(["plan", "Qwen3.5-0.8B", "--kv-dtype", "float32", "--memory", "8GiB",
                 "--kv-cache-dtype", "int8", "--json"]) == 0
    groups = json.loads(capsys.readouterr().out)["groups"]
    by_kind = {g["kind"]: g for g in groups}
    assert by_kind["full"]["dtype"] == "int8"
    assert by_kind["full"]["bytes_per_token"] == by_kind["full"]["block_bytes"] / 16
    assert by_kind["mamba"]["dtype"] == "float32"
    assert by_kind["mamba"]["bytes_per_token"] is None


def test_plan_refuses_a_skip_naming_no_group_in_one_line(capsys):
    assert main(["plan", "Llama-3.1-8B", "--kv-cache-dtype", "int8",
                 "--kv-cache-dtype-skip", "sliding"]) == 2
    err = capsys.readouterr().err.strip()
    assert "names no layer of this model" in err and "\n" not in err
