"""KV sharing on architectures that transformers runs without it: a Llama / Qwen3 model whose
`config.json` maps later layers to earlier layers' KV caches (`kv_sharing_target_layers`,
YOCO-style). The reference is the transformers model with each sharing layer's attention
replaced, in this test, by one that takes its keys and values from the target layer (the
target's k/v projections, norm and RoPE on the target's input); everything else is
transformers' own code. Greedy decoding recomputes the whole sequence each step (no cache)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridkv import LLM, SamplingParams  # noqa: E402
from tests.hooks import record_logits  # noqa: E402
from tests.models.tiny import build_tiny_model  # noqa: E402

NUM_NEW = 12
CASES = {
    # 4 full layers; layers 2 and 3 read layers 0 and 1.
    "llama": ("llama", {"num_hidden_layers": 4}, {2: 0, 3: 1}),
    # Layers 0-1 full, 2-5 sliding (window 16): layer 1 reads 0 (not in the trailing run, so
    # fast prefill starts at layer 4); sliding layers 4 and 5 read sliding layers 2 and 3.
    "qwen3_swa": ("qwen3_swa", {"num_hidden_layers": 6}, {1: 0, 4: 2, 5: 3}),
}


def _reference_model(model_dir: Path, sharing: dict[int, int]):
    from transformers.models.llama.modeling_llama import (
        apply_rotary_pos_emb,
        eager_attention_forward,
    )

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    layers = model.model.layers
    inputs: dict[object, torch.Tensor] = {}  # target attention -> its input this forward

    def remember(target):
        def hook(module, args, kwargs):
            inputs[target] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return hook

    def shared_forward(attn, target):
        def forward(hidden_states, position_embeddings, attention_mask=None, **kwargs):
            shape = (*hidden_states.shape[:-1], -1, attn.head_dim)
            q = attn.q_proj(hidden_states).view(shape)
            if hasattr(attn, "q_norm"):
                q = attn.q_norm(q)
            src = inputs[target]
            k = target.k_proj(src).view(shape)
            if hasattr(target, "k_norm"):
                k = target.k_norm(k)
            v = target.v_proj(src).view(shape).transpose(1, 2)
            cos, sin = position_embeddings
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            out, _ = eager_attention_forward(attn, q, k, v, attention_mask,
                                             scaling=attn.scaling, dropout=0.0)
            return attn.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None
        return forward

    for layer, target in sharing.items():
        target_attn = layers[target].self_attn
        target_attn.register_forward_pre_hook(remember(target_attn), with_kwargs=True)
        layers[layer].self_attn.forward = shared_forward(layers[layer].self_attn, target_attn)
    return model


def _greedy(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    ids = list(prompt)
    logits = []
    with torch.no_grad():
        for _ in range(NUM_NEW):
            out = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            logits.append(out)
            ids.append(int(out.argmax()))
    return ids[len(prompt):], torch.stack(logits)


@pytest.fixture(scope="module", params=sorted(CASES))
def shared_model(request, tmp_path_factory):
    arch, overrides, sharing = CASES[request.param]
    model_dir = build_tiny_model(arch, tmp_path_factory.mktemp(request.param), **overrides)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["kv_sharing_target_layers"] = {str(k): v for k, v in sharing.items()}
    config_path.write_text(json.dumps(config))
    model = _reference_model(model_dir, sharing)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, 256, (n,), generator=gen).tolist() for n in (40, 23, 7)]
    refs = [_greedy(model, p) for p in prompts]
    return model_dir, sharing, prompts, refs


def _run(model_dir, prompts, **options):
    options = {"dtype": "float32", "max_model_len": 128, "kv_cache_memory": "4MiB", **options}
    llm = LLM(str(model_dir), **options)
    llm.logits = record_logits(llm)
    return llm, llm.generate(prompts, SamplingParams(max_tokens=NUM_NEW))


@pytest.mark.parametrize("options", [
    {}, {"kv_sharing_fast_prefill": True},
    {"kv_sharing_fast_prefill": True, "max_num_batched_tokens": 9},
], ids=["plain", "fast_prefill", "fast_prefill_chunked"])
def test_shared_kv_matches_the_reference(shared_model, options):
    model_dir, sharing, prompts, refs = shared_model
    llm, outs = _run(model_dir, prompts, **options)
    for out, (tokens, logits) in zip(outs, refs, strict=True):
        assert out.token_ids == tokens
        ours = torch.stack(llm.logits[out.request_id])
        torch.testing.assert_close(ours, logits, atol=2e-4, rtol=1e-4)
    # Sharing layers own no pages: the groups list only the layers with their own cache.
    groups = llm.engine.plan.config.groups
    owned = {name for g in groups for name in g.layer_names}
    shared = {name for g in groups for name in g.shared_layer_names}
    assert shared == {f"model.layers.{i}.self_attn" for i in sharing}
    assert not owned & shared


def test_a_layer_may_not_read_a_later_or_different_layer(tmp_path):
    from hybridkv.models.layer_mix import kv_layout_from_config

    config = json.loads((build_tiny_model("qwen3_swa", tmp_path, num_hidden_layers=6)
                         / "config.json").read_text())
    for bad, message in [({"1": 3}, "earlier layer"), ({"4": 1}, "same kind"),
                         ({"x": 1}, "layer indices")]:
        with pytest.raises(ValueError, match=message):
            kv_layout_from_config({**config, "kv_sharing_target_layers": bad})


def test_fast_prefill_needs_a_model_with_kv_sharing_layers(tmp_path):
    model_dir = build_tiny_model("llama", tmp_path)
    with pytest.raises(ValueError, match="kv_sharing_fast_prefill needs a model"):
        LLM(str(model_dir), kv_sharing_fast_prefill=True, kv_cache_memory="4MiB",
            max_model_len=64)


def test_families_without_kv_sharing_refuse_a_sharing_map(tmp_path):
    model_dir = build_tiny_model("bamba", tmp_path)  # attention layers 1 and 3
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "kv_sharing_target_layers": {"3": 1}}))
    with pytest.raises(NotImplementedError, match="bamba: layers reading another layer"):
        LLM(str(model_dir), kv_cache_memory="4MiB", max_model_len=64)
