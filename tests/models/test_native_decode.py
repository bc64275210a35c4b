"""Decode steps through the layers' one C call (models/native_decode.py) against the same
model run operator by operator: the same tokens and logits, on GGUF files of tiny random
Llama and Gemma 3 models (sliding windows shorter than the prompts, several rows of
different lengths at once), and the one-line reason where a model does not fit."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from hybridkv import LLM, SamplingParams
from hybridkv.models import native_decode
from hybridkv.worker.linear import quant
from tests.hooks import record_logits
from tests.models.gguf_writer import write_gguf
from tests.models.tiny import build_tiny_model

pytest.importorskip("gguf")

WIDE = dict(hidden_size=256, intermediate_size=512, head_dim=64, num_attention_heads=4,
            num_key_value_heads=2)
TYPES = {"token_embd": T.Q8_0, "attn_q": T.Q4_K, "attn_k": T.Q5_0, "attn_v": T.Q6_K,
         "attn_output": T.Q5_K, "ffn_gate": T.Q4_0, "ffn_up": T.Q4_1, "ffn_down": T.Q5_1,
         "output": T.Q8_0}
# Gate and up of one type: one matrix, whose product applies the activation.
ONE_GATE_UP = {**TYPES, "ffn_up": T.Q4_0}
CASES = {
    "llama": ("llama", {}, TYPES),
    # Q8_0 layers: gate and up in one matrix.
    "llama_q8_0": ("llama", {}, {name: T.Q8_0 for name in TYPES}),
    # q/k norms, sandwich norms, GELU-tanh, windows of 16 under 30-token prompts.
    "gemma3": ("gemma3", dict(head_dim=256, num_attention_heads=2, num_key_value_heads=1,
                              query_pre_attn_scalar=256, tie_word_embeddings=True),
               ONE_GATE_UP),
    # Gated DeltaNet layers (q|k|v, z, b, a apart; value heads reordered in the file, so
    # ordered in-projections and an out_proj reading its input in the file's order), and
    # attention with an output gate, partial RoPE and zero-centred norms.
    "qwen3_5": ("qwen3_5_text", dict(linear_key_head_dim=64, linear_value_head_dim=64),
                {**TYPES, "attn_qkv": T.Q6_K, "attn_gate": T.Q4_K, "ssm_alpha": T.Q5_K,
                 "ssm_beta": T.Q4_0, "ssm_out": T.Q4_K}),
    # Short convolutions beside attention with q/k norms.
    "lfm2": ("lfm2", {}, {**TYPES, "shortconv.in_proj": T.Q4_K, "shortconv.out_proj": T.Q6_K}),
}
# Families with state layers: the state's decode steps in the C sequence.
STATE = {"qwen3_5", "lfm2"}


@pytest.fixture(scope="module", params=sorted(CASES))
def gguf_file(request, tmp_path_factory):
    arch, overrides, types = CASES[request.param]
    root = tmp_path_factory.mktemp(f"native_{request.param}")
    model_dir = build_tiny_model(arch, root / "hf", **{**WIDE, **overrides})
    return request.param, write_gguf(model_dir, root / "model.gguf", types)


def _model(llm):
    return llm.engine.runner.model


def _generate(llm, prompts, native):
    """(tokens, logits) per prompt, with the model's native decode on or off."""
    model = _model(llm)
    kept = model.native_decode
    model.native_decode = kept if native else None
    try:
        logits = record_logits(llm)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12),
                            use_tqdm=False)
    finally:
        model.native_decode = kept
    return [o.token_ids for o in outs], [torch.stack(logits[o.request_id]) for o in outs]


@pytest.mark.parametrize("num_prompts", [4, 8, 20])  # the few-row kernel; the packed tiles
@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_native_decode_equals_the_operator_path(gguf_file, monkeypatch, num_prompts,
                                                activations):
    case, path = gguf_file
    if activations == "int8" and (case not in STATE or not quant.int8_capable(T.Q4_K)):
        pytest.skip("8-bit activations: the state families (AVX2 kernels)")
    calls: list[int] = []
    run = native_decode.NativeDecode.__call__

    def counted(self, h, positions, ctx):
        calls.append(h.shape[0])
        return run(self, h, positions, ctx)

    monkeypatch.setattr(native_decode.NativeDecode, "__call__", counted)
    gen = torch.Generator().manual_seed(5)
    lengths = [(30, 3, 17, 24)[i % 4] + i for i in range(num_prompts)]
    prompts = [torch.randint(4, 250, (n,), generator=gen).tolist() for n in lengths]
    # Each run on an engine of its own: a prefix hit on the first run's prompts would start a
    # state layer's prompt from a checkpoint, other sums than a whole prompt's.
    results = []
    for native in (True, False):
        llm = LLM(str(path), max_model_len=128, kv_cache_memory="16MiB",
                  quant_activations=activations)
        assert isinstance(_model(llm).native_decode, native_decode.NativeDecode)
        results.append(_generate(llm, prompts, native=native))
        if native:
            # Every step after the prompts is a decode, of up to all the prompts' rows (for
            # state families some are not: a step saving a state checkpoint at a block's
            # end runs layer by layer between native ones, from the states they left).
            assert calls and max(calls) == num_prompts
            seen = len(calls)
    assert len(calls) == seen
    (tokens, logits), (ref_tokens, ref_logits) = results
    assert tokens == ref_tokens
    for ours, ref in zip(logits, ref_logits, strict=True):
        # The same kernels on both paths: the same bytes.
        assert torch.equal(ours, ref), (ours - ref).abs().max()


def test_a_float_model_says_why_it_runs_layer_by_layer(tmp_path):
    model_dir = build_tiny_model("llama", tmp_path / "hf")
    llm = LLM(str(model_dir), max_model_len=64, kv_cache_memory="4MiB")
    model = _model(llm)
    assert model.native_decode is None
    reason = native_decode.attach(model)
    assert reason is not None and "\n" not in reason
    assert "GGUF-quantized" in reason and "layer 0" in reason
    assert model.native_decode is None
