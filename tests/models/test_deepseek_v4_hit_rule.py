"""What a prefix hit of DeepSeek-V4 needs, checked on transformers' own model and caches
(`DeepseekV4CSACache`, `DeepseekV4HCACache`) rather than argued: a tiny random model runs a
prompt whole, and again resumed at a window boundary from only what hybridkv keeps for a
hit (the sliding window, the compressed entries and indexer keys, CSA's checkpoint of the
last window's first halves; no compressor buffer). The logits agree; without the CSA
checkpoint they do not. The buffers at their fullest have the shapes of hybridkv's
compressor-state specs (kv/spec.py CompressorStateSpec, models/layer_mix.py)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridkv.models.layer_mix import kv_layout_from_config  # noqa: E402

CSA_RATE, HCA_RATE = 4, 8
SLIDING, CSA, HCA = 0, 1, 2  # layer indices
HIT = 16  # a window boundary of both rates


def tiny_model():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    config = transformers.DeepseekV4Config(
        vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=2, head_dim=16, q_lora_rank=16, partial_rotary_factor=0.5,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        layer_types=["sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": CSA_RATE,
                        "heavily_compressed_attention": HCA_RATE},
        sliding_window=6, o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=8,
        index_topk=3, hc_mult=2, max_position_embeddings=256)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():
        # Random weights everywhere (position biases and sinks included: an all-zero bias
        # would hide what the overlap carries).
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.3)
    return model


def as_hit(cache, *, keep_overlap: bool):  # type: ignore[no-untyped-def]
    """The prefix's cache as a hit restores it: every compressor buffer fresh (None), the
    CSA layer's overlap from its checkpoint (or not)."""
    hit = copy.deepcopy(cache)
    for layer in (hit.layers[CSA], hit.layers[HCA]):
        for name in layer.buffer_kv:
            layer.buffer_kv[name] = layer.buffer_gate[name] = None
    if not keep_overlap:
        for name in hit.layers[CSA].overlap_kv:
            hit.layers[CSA].overlap_kv[name] = hit.layers[CSA].overlap_gate[name] = None
    return hit


def test_a_hit_at_a_window_boundary_needs_only_entries_window_and_the_csa_overlap():
    model = tiny_model()
    ids = torch.randint(0, 64, (1, 26))
    with torch.no_grad():
        whole = model(ids).logits[:, HIT:]
        prefix = model(ids[:, :HIT], use_cache=True).past_key_values
        # At the boundary the buffers hold nothing: the hit point's state is the overlap.
        for layer in (prefix.layers[CSA], prefix.layers[HCA]):
            assert all(b.shape[1] == 0 for b in layer.buffer_kv.values())
        assert not hasattr(prefix.layers[HCA], "overlap_kv")  # HCA carries nothing else
        resumed = model(ids[:, HIT:], past_key_values=as_hit(prefix, keep_overlap=True)).logits
        blind = model(ids[:, HIT:], past_key_values=as_hit(prefix, keep_overlap=False)).logits
    torch.testing.assert_close(resumed, whole, rtol=1e-4, atol=1e-4)
    # Without the checkpoint the first entry after the hit (closed by token HIT + 3) is
    # wrong, and so is every query reading it.
    diff = (blind - whole).abs().amax(dim=-1)[0]
    assert diff[:CSA_RATE - 1].max() < 1e-4 and diff[CSA_RATE - 1:].min() > 1e-3


def test_the_fullest_buffers_have_the_compressor_states_shapes():
    model = tiny_model()
    # 23 tokens: 3 past a CSA window, 7 past an HCA window, the most either buffer holds.
    ids = torch.randint(0, 64, (1, 23))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    csa, hca = cache.layers[CSA], cache.layers[HCA]
    observed = {
        CSA: [tuple(t.shape[1:]) for t in (csa.buffer_kv["compressor"],
                                           csa.buffer_gate["compressor"],
                                           csa.overlap_kv["compressor"],
                                           csa.overlap_gate["compressor"],
                                           csa.buffer_kv["indexer"], csa.buffer_gate["indexer"],
                                           csa.overlap_kv["indexer"], csa.overlap_gate["indexer"])],
        HCA: [tuple(t.shape[1:]) for t in (hca.buffer_kv["compressor"],
                                           hca.buffer_gate["compressor"])],
    }
    specs = kv_layout_from_config(model.config.to_dict()).layer_specs
    for layer in (CSA, HCA):
        spec = specs[f"model.layers.{layer}.self_attn.compressor_state"]
        assert list(spec.shapes) == observed[layer]  # type: ignore[attr-defined]
        assert spec.overlap == (layer == CSA)  # type: ignore[attr-defined]
