"""GGUF files of tiny random models, written by the tests (gguf_writer.py), under hybridkv with
their weights kept quantized, against transformers reading the same file (it dequantizes to
float32) and against hybridkv on that dequantized model saved as safetensors: greedy tokens
equal, logits close."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T
from safetensors.torch import save_file

from hybridkv import LLM, SamplingParams
from tests.hooks import record_logits
from tests.models.gguf_writer import write_gguf
from tests.models.llamacpp_convert import add_mtp_layer
from tests.models.test_against_transformers import NUM_NEW, PROMPT_LENS, hf_reference
from tests.models.tiny import build_tiny_model

pytest.importorskip("accelerate")  # transformers' GGUF reader needs it

# Wide enough for K-quants (rows of 256 values).
WIDE = dict(hidden_size=256, intermediate_size=512, head_dim=64, num_attention_heads=4,
            num_key_value_heads=2)
# Every type the kernels compute on appears in some model below.
MIXED = {"token_embd": T.Q8_0, "attn_q": T.Q4_K, "attn_k": T.Q5_0, "attn_v": T.Q6_K,
         "attn_output": T.Q5_K, "ffn_gate": T.Q4_0, "ffn_up": T.Q4_1, "ffn_down": T.Q5_1,
         "output": T.F16}
OTHER = {"token_embd": T.BF16, "attn_q": T.F16, "attn_k": T.F32, "attn_v": T.Q8_0,
         "ffn": T.Q6_K, "output": T.Q4_K}
# A GGUF file does not store Gemma's query scale: llama.cpp takes the key length, transformers
# its default 256; heads of 256 make both agree.
MOE = dict(moe_intermediate_size=256)  # rows of 256 for K-quants on ffn_down_exps
SSM = {"token_embd": T.Q5_0, "ssm_in": T.Q4_K, "ssm_x": T.Q8_0, "ssm_out": T.Q6_K,
       "output": T.Q4_0}
GEMMA_HEADS = dict(head_dim=256, num_attention_heads=2, num_key_value_heads=1,
                   query_pre_attn_scalar=256)
# Block types only (rounded references); rows of 64 or 128.
HYBRID_TYPES = {"ssm_in": T.Q4_0, "ssm_out": T.Q5_0, "attn_q": T.Q5_1, "attn_v": T.Q4_1,
                "ffn_up": T.Q4_1, "ffn_down": T.Q5_0, "ffn_gate": T.Q5_1, "output": T.F16}
CASES = {
    # name: (tiny arch, config overrides, types)
    "llama": ("llama", {}, MIXED),
    "llama_f": ("llama", dict(tie_word_embeddings=True), OTHER),
    "qwen2": ("qwen2", {}, MIXED),
    # transformers' Qwen3 GGUF reader keeps its default head size (128), not the file's.
    "qwen3": ("qwen3", dict(head_dim=128, num_attention_heads=2, num_key_value_heads=1),
              OTHER),
    "gemma2": ("gemma2", dict(GEMMA_HEADS, tie_word_embeddings=True), MIXED),
    "gemma3": ("gemma3", dict(GEMMA_HEADS, num_hidden_layers=6, tie_word_embeddings=True,
                              sliding_window_pattern=6), MIXED),
    # Experts as 3-D tensors split per expert; a shared expert with its sigmoid gate.
    "qwen2_moe": ("qwen2_moe", dict(MOE, num_hidden_layers=2, mlp_only_layers=[],
                                    shared_expert_intermediate_size=512), MIXED),
    "qwen3_moe": ("qwen3_moe", dict(MOE, use_sliding_window=False), OTHER),
    "mamba": ("mamba", {}, SSM),
    # transformers cannot read Mamba-2 GGUF files: the reference is the checkpoint with each
    # weight rounded as the file stores it.
    "mamba2": ("mamba2", dict(hidden_size=64, intermediate_size=128, head_dim=16),
               {"ssm_in": T.Q4_0, "output": T.F16}),
    # Fused attn_qkv split into q/k/v; fused gate|up; RoPE on half of each head; sliding.
    "phi3": ("phi3", {}, MIXED),
    # Biased LayerNorms and projections, gelu c_fc/c_proj MLP.
    "starcoder2": ("starcoder2", {}, MIXED),
    # Short convolutions + attention (per-layer head_count_kv); a byte vocabulary in the file.
    "lfm2": ("lfm2", {}, OTHER),
    # Hybrids (Mamba-2 + attention + MLP layers), against the rounded checkpoint too: the
    # layer mix comes from the per-layer head_count_kv / feed_forward_length lists.
    "nemotron_h": ("nemotron_h", dict(hidden_size=64, intermediate_size=128, head_dim=16),
                   HYBRID_TYPES),
    # Experts and shared MLP with gate|up fused in one projection: split in the file, joined
    # back on loading (the shared one's halves of one type: their blocks joined as they are).
    "granitemoehybrid": ("granitemoehybrid", dict(hidden_size=64, intermediate_size=32,
                                                   head_dim=16),
                         {"ffn_up_shexp": T.Q5_1, **HYBRID_TYPES}),
    # Mamba-1 + attention every 2nd layer, experts every 2nd layer (read off the routers).
    "jamba": ("jamba", dict(hidden_size=64, intermediate_size=128, head_dim=16),
              {"ssm_x": T.Q8_0, "ffn_gate_exps": T.Q4_0, **HYBRID_TYPES}),
    # Attention and Mamba-2 in parallel; the µP multipliers folded into the file's weights
    # (the rounded reference holds the folded weights and multipliers of 1).
    "falcon_h1": ("falcon_h1", dict(hidden_size=64, intermediate_size=128, head_dim=16),
                  HYBRID_TYPES),
    # Post-norm families with a sliding pattern; SmolLM3 with NoPE every 4th layer (the step
    # llama.cpp fixes) and its q/k permuted as LlamaModel's converter does. Against the
    # rounded checkpoint (transformers reads none of them from GGUF).
    "exaone4": ("exaone4", dict(hidden_size=64, intermediate_size=128, head_dim=16),
                HYBRID_TYPES),
    "olmo3": ("olmo3", dict(hidden_size=64, intermediate_size=128, head_dim=16),
              HYBRID_TYPES),
    "smollm3": ("smollm3", dict(hidden_size=64, intermediate_size=128, head_dim=16,
                                no_rope_layers=[1, 1, 1, 0], use_sliding_window=False),
                HYBRID_TYPES),
    # Gated DeltaNet hybrids as llama.cpp's converter rewrites them (A = -exp(A_log), norms
    # as 1 + w but the gated one, squeezed conv kernels); Qwen3.5's value heads tiled (its
    # out projection's columns too: ssm_out in blocks), Qwen3-Next's in_proj_qkvz split in
    # two and reordered. Against the rounded checkpoint (no transformers GGUF reader).
    "qwen3_5": ("qwen3_5_text", dict(hidden_size=64, intermediate_size=128, head_dim=16),
                {"attn_qkv": T.Q8_0, "attn_gate": T.Q4_1, "ssm_alpha": T.Q5_1, **HYBRID_TYPES}),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(hidden_size=64, intermediate_size=128,
                                             head_dim=16), HYBRID_TYPES),
    "qwen3_next": ("qwen3_next", dict(hidden_size=64, intermediate_size=128, head_dim=16),
                   {"attn_qkv": T.Q5_1, "attn_gate": T.Q4_0, "ssm_ba": T.Q5_0,
                    **HYBRID_TYPES}),
    # LFM2-MoE: a dense first layer, then sigmoid-routed experts with a selection bias;
    # tied embeddings and a routed scale of 1, as released (the file has no key for it).
    "lfm2_moe": ("lfm2_moe", dict(hidden_size=64, intermediate_size=128, head_dim=16,
                                  tie_word_embeddings=True, routed_scaling_factor=1.0),
                 {"ffn_gate_exps": T.Q4_0, "ffn_down_exps": T.Q5_1, **HYBRID_TYPES}),
    # Gemma 3n as Gemma3NModel's converter writes it: AltUp projections stacked in one tensor
    # each, the per-layer table (200 rows) padded with zeros to the vocabulary, activation
    # sparsity as a normal quantile; Gemma 4's full layers (head size 32, one KV head, K = V)
    # with proportional RoPE in rope_freqs, double-width shared-KV MLPs, stacked experts kept
    # in their blocks, the router's scales as `.scale` tensors.
    "gemma3n": ("gemma3n", dict(hidden_size=64, intermediate_size=128, head_dim=16),
                {"altup_proj": T.Q4_0, "altup_unembd_proj": T.Q5_1, "laurel_l": T.Q4_1,
                 "per_layer_token_embd": T.Q5_0, **HYBRID_TYPES}),
    "gemma4": ("gemma4_text", dict(hidden_size=64, intermediate_size=128, head_dim=16),
               {"ffn_gate_up_exps": T.Q4_1, "ffn_down_exps": T.Q5_0,
                "per_layer_token_embd": T.Q8_0, **HYBRID_TYPES}),
}
# Config fields transformers' GGUF reader leaves at its defaults (it reads no
# expert_feed_forward_length, nor expert_shared_feed_forward_length): given to it
# by hand, as the file says them to hybridkv.
HF_KWARGS = {
    "qwen2_moe": dict(moe_intermediate_size=256, shared_expert_intermediate_size=512),
    "qwen3_moe": dict(moe_intermediate_size=256),
    # Its StarCoder 2 reader takes the vocabulary size from tokenizer.ggml.tokens only.
    "starcoder2": dict(vocab_size=256),
    # Nor Phi-3's rope.dimension_count, nor its attention.sliding_window.
    "phi3": dict(sliding_window=16, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                     "partial_rotary_factor": 0.5}),
}
ROUNDED = {"mamba2", "nemotron_h", "granitemoehybrid", "jamba", "falcon_h1", "exaone4", "olmo3",
           "smollm3", "qwen3_5", "qwen3_5_moe", "qwen3_next", "lfm2_moe", "gemma3n", "gemma4"}
ARCH_OF = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_hidden_layers=2))}
# Checkpoints given a multi-token-prediction block (as released), shaped as this layer: the
# writer puts it after the model's layers as llama.cpp's converter does (`nextn`).
MTP = {"qwen3_5": 3, "qwen3_5_moe": 3, "qwen3_next": 3}


@pytest.fixture(scope="module", params=sorted(CASES))
def gguf_case(request, tmp_path_factory):
    """(GGUF path, prompts, transformers' tokens and logits on it)."""
    from tests.models import tiny

    name = request.param
    arch, overrides, qtypes = CASES[name]
    if arch not in tiny.ARCHS:
        tiny.ARCHS[arch] = ARCH_OF[arch]
    root = tmp_path_factory.mktemp(f"gguf_{name}")
    model_dir = build_tiny_model(arch, root / "hf", **{**WIDE, **overrides})
    if name in MTP:
        add_mtp_layer(model_dir, source_layer=MTP[name])
    rounded = root / "rounded" if name in ROUNDED else None
    path = write_gguf(model_dir, root / "model.gguf", qtypes, rounded=rounded)
    gen = torch.Generator().manual_seed(99)
    prompts = [torch.randint(4, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    if rounded is not None:
        return name, path, rounded, prompts, *hf_reference(rounded, prompts)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(root), gguf_file="model.gguf", dtype=torch.float32,
        **HF_KWARGS.get(name, {})).eval()
    dequantized = root / "dequantized"
    # transformers refuses save_pretrained on a GGUF-loaded model: config and tensors apart.
    hf.config.save_pretrained(dequantized)
    state = {k: v.contiguous().clone() for k, v in _per_expert(hf.state_dict()).items()
             if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
    save_file(state, str(dequantized / "model.safetensors"))
    return name, path, dequantized, prompts, *hf_reference(dequantized, prompts)


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers keeps experts fused in memory ([experts, 2 * ff, hidden] gate_up,
    [experts, hidden, ff] down); checkpoints hold them per expert."""
    out = {}
    for key, value in state.items():
        prefix, _, part = key.rpartition(".experts.")
        if part == "gate_up_proj":
            gate, up = value.chunk(2, dim=1)
            for e in range(value.shape[0]):
                out[f"{prefix}.experts.{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}.experts.{e}.up_proj.weight"] = up[e]
        elif part == "down_proj":
            for e in range(value.shape[0]):
                out[f"{prefix}.experts.{e}.down_proj.weight"] = value[e]
        else:
            out[key] = value
    return out


def _run(model: Path, prompts, **options):
    llm = LLM(str(model), max_model_len=128, kv_cache_memory="8MiB", **options)
    llm.logits = record_logits(llm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NUM_NEW))
    return llm, outs


def _check(llm, outs, tokens, logits, atol):
    for out, ref_tokens, ref_logits in zip(outs, tokens, logits, strict=True):
        assert out.token_ids == ref_tokens
        ours = torch.stack(llm.logits.pop(out.request_id))
        torch.testing.assert_close(ours, ref_logits, atol=atol, rtol=1e-3)


def test_quantized_gguf_matches_transformers(gguf_case):
    """And an MTP block (`nextn` layers after the model's own) is not run but listed, its
    tensors left in the file, for a multi-token-prediction head."""
    name, path, _, prompts, tokens, logits = gguf_case
    llm, outs = _run(path, prompts)
    _check(llm, outs, tokens, logits, atol=2e-3)
    model = llm.engine.runner.model
    mtp = {info.name for info in model.mtp_tensors}
    if name not in MTP:
        assert not mtp
        return
    last = len(model.model.layers)
    assert {f"blk.{last}.nextn.eh_proj.weight", f"blk.{last}.nextn.enorm.weight",
            f"blk.{last}.nextn.hnorm.weight", f"blk.{last}.nextn.shared_head_norm.weight",
            f"blk.{last}.attn_q.weight"} <= mtp
    assert {n.split(".")[1] for n in mtp} == {str(last)}


def test_quantized_gguf_matches_the_dequantized_checkpoint(gguf_case):
    """The same weights as float32 safetensors under hybridkv: only the kernels differ."""
    name, path, dequantized, prompts, _, _ = gguf_case
    ref, ref_outs = _run(dequantized, prompts, dtype="float32")
    llm, outs = _run(path, prompts)
    for a, b in zip(outs, ref_outs, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.stack(llm.logits.pop(a.request_id)),
                                   torch.stack(ref.logits.pop(b.request_id)),
                                   atol=2e-3, rtol=1e-3)


def test_dequantize_option_runs_float_weights(gguf_case):
    name, path, _, prompts, tokens, logits = gguf_case
    llm, outs = _run(path, prompts, dequantize=True)
    from hybridkv.worker.linear.quantized import QuantizedLinear
    model = llm.engine.runner.model
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    _check(llm, outs, tokens, logits, atol=1e-3)
