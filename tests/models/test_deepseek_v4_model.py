"""DeepSeek-V4 in the engine beyond the model matrix (tests/models/test_against_transformers.py
runs it in every engine mode; its CSA indexer's ties with the other indexers' in
tests/models/test_indexed_attention.py): prefixes served from the CPU and disk
tiers (compressed entries, indexer keys, the CSA compressor's checkpoint, all moved as
blocks) giving transformers' tokens and logits; and what it refuses at load."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridkv import LLM, SamplingParams  # noqa: E402
from tests.models.test_against_transformers import (  # noqa: E402
    NUM_NEW,
    PROMPT_LENS,
    check,
    hf_reference,
    run,
)
from tests.models.tiny import build_tiny_model  # noqa: E402


def prompts_of(seed: int, lengths=PROMPT_LENS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 256, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("deepseek_v4", tmp_path_factory.mktemp("v4"))


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_a_prefix_from_a_tier_gives_transformers_outputs(tier, model_dir, tmp_path):
    # 41 and 75 tokens: hits at 32 and 64, where CSA needs its overlap checkpoint.
    prompts = prompts_of(7, (41, 75))
    tokens, logits = hf_reference(model_dir, prompts)
    where = dict(kv_offload_cpu="64MiB") if tier == "cpu" else dict(
        kv_offload_disk=f"{tmp_path}:64MiB")
    llm, outs = run(model_dir, prompts, **where)
    check(llm, outs, tokens, logits)
    assert llm.reset_prefix_cache() is True  # the device cache goes: hits come from the tier
    again = llm.generate(prompts, SamplingParams(max_tokens=NUM_NEW))
    check(llm, again, tokens, logits)
    assert [o.cached_tokens_by_tier[tier] for o in again] == [32, 64]
    kinds = {g.spec.kind for g in llm.engine.plan.config.groups}
    assert {"compressed", "indexer_key", "compressor_state"} <= kinds
    llm.close()


def test_quantized_pages_are_refused_at_load(model_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8': DeepSeek-V4's window rows"):
        LLM(str(model_dir), kv_cache_dtype="int8", kv_cache_memory="4MiB", max_model_len=128)


def test_fp8_checkpoints_are_refused_in_one_line(model_dir, tmp_path):
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3"}
    for f in model_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="deepseek_v4: quantized checkpoints"):
        LLM(str(tmp_path), kv_cache_memory="4MiB", max_model_len=128)


@pytest.mark.parametrize("name", ["DeepSeek-V4-Flash", "DeepSeek-V4-Pro"])
def test_rope_of_the_released_configs_equals_transformers(name):
    # Their compress layers use YaRN (without its attention factor), the others plain RoPE.
    from importlib import resources

    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    from hybridkv.models.layers.pair_rope import PairRope, rope_parameters

    path = resources.files("hybridkv") / "data" / "model_configs" / f"deepseek-ai__{name}.json"
    raw = json.loads(path.read_text())
    fields = {k: v for k, v in raw.items() if k not in (
        "architectures", "transformers_version", "torch_dtype", "quantization_config")}
    reference = DeepseekV4RotaryEmbedding(transformers.DeepseekV4Config(**fields))
    for label, params in rope_parameters(raw).items():
        ours = PairRope(int(raw["qk_rope_head_dim"]), params,
                        int(raw["max_position_embeddings"]))
        torch.testing.assert_close(ours.inv_freq, getattr(reference, f"{label}_inv_freq"),
                                   rtol=0, atol=0)
        assert ours.scaling == getattr(reference, f"{label}_attention_scaling")
