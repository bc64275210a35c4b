"""Greedy tokens equal and logits close to Hugging Face `transformers` on tiny random models
(float32, CPU), under every engine setting that must not change outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridkv import LLM, SamplingParams  # noqa: E402
from tests.hooks import record_logits  # noqa: E402
from tests.models.tiny import ARCHS as TINY_ARCHS  # noqa: E402
from tests.models.tiny import build_tiny_model  # noqa: E402

ARCHS = list(TINY_ARCHS)  # every architecture tests/models/tiny.py can build
# Architectures whose last layers read earlier layers' KV (fast prefill applies).
KV_SHARING = {"gemma3n", "gemma4_text", "gemma4_unified_text"}
NUM_NEW = 16
# Lengths cross the 16-token windows and the 16-token blocks.
PROMPT_LENS = (40, 23, 7)


@pytest.fixture(scope="module", params=ARCHS)
def reference(request, tmp_path_factory):
    """(model dir, prompts, reference tokens, reference per-step logits) for one arch."""
    name = request.param
    model_dir = build_tiny_model(name, tmp_path_factory.mktemp(name))
    gen = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(4, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return (name, model_dir, prompts, *hf_reference(model_dir, prompts))


def hf_reference(model_dir: Path, prompts):
    """transformers' greedy tokens and per-step logits for each prompt (float32)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return greedy_reference(hf.eval(), prompts)


def greedy_reference(hf, prompts, num_new: int = NUM_NEW):
    """A transformers model's greedy tokens and per-step logits for each prompt."""
    tokens, logits = [], []
    for prompt in prompts:
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=num_new, do_sample=False,
                          eos_token_id=None, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
        tokens.append(out.sequences[0, len(prompt):].tolist())
        logits.append(torch.stack([step[0] for step in out.logits]))
    return tokens, logits


def run(model_dir: Path, prompts, **options):
    options = {"dtype": "float32", "max_model_len": 128, "kv_cache_memory": "4MiB", **options}
    llm = LLM(str(model_dir), **options)
    llm.logits = record_logits(llm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NUM_NEW))
    return llm, outs


def check(llm, outs, tokens, logits, *, atol=2e-4):
    for out, ref_tokens, ref_logits in zip(outs, tokens, logits, strict=True):
        assert out.token_ids == ref_tokens
        ours = torch.stack(llm.logits.pop(out.request_id))
        assert ours.shape == ref_logits.shape
        torch.testing.assert_close(ours, ref_logits, atol=atol, rtol=1e-4)


# Families whose config places the windows by a rule (`max_window_layers`, SmolLM3's
# `no_rope_layers`) when it has no `layer_types`: older checkpoints, and Qwen3-MoE always
# (its config has no such field; its attention slides on every layer).
DERIVED_WINDOWS: dict[str, dict[str, object]] = {
    "qwen2": {}, "qwen3_swa": {}, "qwen2_moe_swa": {}, "qwen3_moe_swa": {}, "smollm3": {},
    "dots1": dict(layer_types=None, max_window_layers=1),
    # Each its own rule (CWM: a full layer every 4th from 0; Kolibri 1: every 5th, so 5
    # layers; Flint: the first two, every 4th from 1 and the last; ...).
    **{name: dict(layer_types=None) for name in ("cwm", "flint", "beam", "modernbert_decoder")},
    "kolibri1": dict(layer_types=None, num_hidden_layers=5),
    # Inkling / Inkling 2: sliding but every 6th layer.
    "inkling": dict(layer_types=None, mlp_layer_types=None, num_hidden_layers=6),
    "inkling2": dict(layer_types=None, num_hidden_layers=6)}


@pytest.mark.parametrize("name", sorted(DERIVED_WINDOWS))
def test_windows_placed_without_layer_types_as_transformers_places_them(name, tmp_path):
    model_dir = build_tiny_model(name, tmp_path, **DERIVED_WINDOWS[name])
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("layer_types", None)
    (model_dir / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(4, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS[:2]]
    tokens, logits = hf_reference(model_dir, prompts)
    llm, outs = run(model_dir, prompts)
    check(llm, outs, tokens, logits)
    assert "sliding_window" in {g.spec.kind for g in llm.engine.plan.config.groups}


def test_mamba2_config_without_intermediate_size(tmp_path):
    # As transformers writes it: Mamba2's config has no intermediate_size (expand x hidden).
    model_dir = build_tiny_model("mamba2", tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    del config["intermediate_size"]
    (model_dir / "config.json").write_text(json.dumps(config))
    prompts = [torch.randint(4, 256, (23,), generator=torch.Generator().manual_seed(1)).tolist()]
    llm, outs = run(model_dir, prompts)
    check(llm, outs, *hf_reference(model_dir, prompts))


def test_batch_matches_transformers(reference):
    _, model_dir, prompts, tokens, logits = reference
    llm, outs = run(model_dir, prompts)
    check(llm, outs, tokens, logits)
    assert all(o.finish_reason == "length" for o in outs)


def test_prefix_cache_hit_gives_the_same_outputs(reference):
    _, model_dir, prompts, tokens, logits = reference
    llm, first = run(model_dir, prompts[:1])
    check(llm, first, tokens[:1], logits[:1])
    # The same prompt again: every full block but the last token's is reused (for state
    # layers: the state checkpoint saved at the end of the first prompt's last full block).
    again = llm.generate(prompts[:1], SamplingParams(max_tokens=NUM_NEW))
    check(llm, again, tokens[:1], logits[:1])
    stats = llm.engine.kv_manager.stats
    assert stats.num_hit_tokens == (len(prompts[0]) - 1) // 16 * 16 > 0


def test_prefix_caching_off(reference):
    # Also the "torch" linear kernel and attention backend (what CUDA runs; the other cases
    # run oneDNN's GEMMs and the C attention, norms and RoPE on CPU).
    _, model_dir, prompts, tokens, logits = reference
    llm, outs = run(model_dir, prompts, enable_prefix_caching=False, linear_kernel="torch",
                    attention_backend="torch")
    assert llm.engine.runner.backend.name == "torch"
    check(llm, outs, tokens, logits)
    assert llm.engine.kv_manager.stats.num_hit_tokens == 0


def test_chunked_prefill_with_a_small_budget(reference):
    _, model_dir, prompts, tokens, logits = reference
    llm, outs = run(model_dir, prompts, max_num_batched_tokens=9)
    check(llm, outs, tokens, logits)


def test_preemption_under_a_tiny_memory_budget(reference):
    check_with_preemption(reference)


def check_with_preemption(reference, **options):
    _, model_dir, prompts, tokens, logits = reference
    # Each prompt twice: more requests than a budget just above the planner's minimum holds
    # at once (for state models that minimum includes the checkpoint blocks one request can
    # take in a step, so three requests alone may never need to preempt).
    prompts, tokens, logits = prompts * 2, tokens * 2, logits * 2
    probe, _ = run(model_dir, prompts[:1], max_model_len=64, **options)
    large_page = probe.engine.plan.config.large_page_bytes
    preempted = 0
    # Budgets of a few large pages; prompts admitted in chunks of 16 tokens, so that more
    # requests start than can grow (hybrid models free window/chunk blocks as they go, and
    # with whole-prompt admission the admission itself would be the only bottleneck).
    for num_pages in range(4, 24):
        try:
            llm, outs = run(model_dir, prompts, max_model_len=64, max_num_batched_tokens=16,
                            kv_cache_memory=num_pages * large_page, **options)
        except ValueError as e:
            assert "too small for one request" in str(e)
            continue
        check(llm, outs, tokens, logits)
        preempted += llm.engine.scheduler.num_preemptions
        if preempted:
            break
    assert preempted > 0


def test_hybrid_management_off(reference):
    _, model_dir, prompts, tokens, logits = reference
    llm, outs = run(model_dir, prompts, disable_hybrid_kv_cache=True)
    check(llm, outs, tokens, logits)
    # Windows and chunks become full attention; state layers stay state layers (pure state
    # models have no attention group).
    kinds = {g.spec.kind for g in llm.engine.plan.config.groups}
    assert not kinds & {"sliding_window", "chunked_local"}
    assert "full" in kinds or all(g.spec.is_state for g in llm.engine.plan.config.groups)


def test_kernel_block_size_below_the_manager_block_size(reference):
    _, model_dir, prompts, tokens, logits = reference
    llm, outs = run(model_dir, prompts, block_size=16, kernel_block_size=4)
    check(llm, outs, tokens, logits)


def test_kv_sharing_fast_prefill(reference):
    """Layers that only read shared KV run on the sampled tokens: same outputs in a mixed
    batch, with chunks that do not finish their prompt, after a prefix hit, and with
    preemption; the sharing layers allocate nothing."""
    name, model_dir, prompts, tokens, logits = reference
    if name not in KV_SHARING:
        pytest.skip("no KV-sharing layers")
    llm, outs = run(model_dir, prompts, kv_sharing_fast_prefill=True)
    check(llm, outs, tokens, logits)
    assert all(g.shared_layer_names for g in llm.engine.plan.config.groups)
    again = llm.generate(prompts[:1], SamplingParams(max_tokens=NUM_NEW))
    check(llm, again, tokens[:1], logits[:1])
    assert llm.engine.kv_manager.stats.num_hit_tokens > 0
    llm, outs = run(model_dir, prompts, kv_sharing_fast_prefill=True, max_num_batched_tokens=9)
    check(llm, outs, tokens, logits)
    check_with_preemption(reference, kv_sharing_fast_prefill=True)
