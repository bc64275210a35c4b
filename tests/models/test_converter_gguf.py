"""Tiny random models of the hybrid families, written to GGUF by llama.cpp's own converter
(tests/models/llamacpp_convert.py), under hybridkv: greedy tokens equal to transformers on the
same weights (f32), and the quantized files (q8_0, q4_0) equal to the same file with its
weights dequantized to float32. Runs where the llama.cpp source is present."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from hybridkv import LLM, SamplingParams
from tests.hooks import record_logits
from tests.models import llamacpp_convert
from tests.models.test_against_transformers import NUM_NEW, PROMPT_LENS, hf_reference
from tests.models.tiny import build_tiny_model

pytestmark = pytest.mark.skipif(not llamacpp_convert.available(),
                                reason=f"no llama.cpp source at {llamacpp_convert.SOURCE}")

# name: (tiny arch, config overrides). What a GGUF file cannot say is left at what the
# released checkpoints use: SmolLM3's NoPE layers every 4th (llama.cpp fixes that step) and no
# window; LFM2-MoE's tied embeddings and routed scale of 1.
CASES: dict[str, tuple[str, dict[str, object]]] = {
    "falcon_h1": ("falcon_h1", {}),
    "qwen3_5": ("qwen3_5_text", {}),
    "qwen3_5_moe": ("qwen3_5_moe_text", {}),
    "qwen3_next": ("qwen3_next", {}),
    "lfm2_moe": ("lfm2_moe", dict(tie_word_embeddings=True, routed_scaling_factor=1.0)),
    "smollm3": ("smollm3", dict(no_rope_layers=[1, 1, 1, 0], use_sliding_window=False)),
    "exaone4": ("exaone4", {}),
    "olmo3": ("olmo3", {}),
    # AltUp, Laurel, per-layer inputs (a per-layer vocabulary of 200 the converter pads with
    # zero rows to 256: transformers reads ids past it as id 0, whose row the padding index
    # keeps at zero), sparse MLP gates, the last 4 layers reading shared KV.
    "gemma3n": ("gemma3n", {}),
    # Full layers with their own head size and KV heads, values = keys (no attn_v), and
    # proportional RoPE (rope_freqs); shared-KV layers with double-width MLPs; experts beside
    # every MLP (ffn_gate_up_exps / ffn_down_exps kept in their blocks).
    "gemma4": ("gemma4_text", {}),
}
# Checkpoints given a multi-token-prediction block (as released), shaped as this layer.
MTP = {"qwen3_5": 3, "qwen3_5_moe": 3, "qwen3_next": 3}


@pytest.fixture(scope="module", params=sorted(CASES))
def converted(request, tmp_path_factory):
    """(name, model dir, {type: GGUF path}, prompts, transformers' tokens and logits)."""
    name = request.param
    arch, overrides = CASES[name]
    root = tmp_path_factory.mktemp(f"convert_{name}")
    model_dir = build_tiny_model(arch, root / "hf", **overrides)
    llamacpp_convert.write_byte_tokenizer(model_dir)
    if name in MTP:
        llamacpp_convert.add_mtp_layer(model_dir, source_layer=MTP[name])
    files = {t: llamacpp_convert.convert(model_dir, root / f"model.{t}.gguf", t)
             for t in ("f32", "q8_0")}
    # Q4_0 as llama-quantize makes it from the converter's f32 file.
    files["q4_0"] = llamacpp_convert.requantize(files["f32"], root / "model.q4_0.gguf", T.Q4_0)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return name, model_dir, files, prompts, *hf_reference(model_dir, prompts)


def _run(path: Path, prompts, **options):
    llm = LLM(str(path), max_model_len=128, kv_cache_memory="8MiB", **options)
    llm.logits = record_logits(llm)
    return llm, llm.generate(prompts, SamplingParams(max_tokens=NUM_NEW))


def test_f32_file_matches_transformers(converted):
    """And the MTP block the converter writes as `nextn` layers after the model's own is not
    run but kept listed (its tensors left in the file) for a multi-token-prediction head."""
    name, _, files, prompts, tokens, logits = converted
    llm, outs = _run(files["f32"], prompts)
    for out, ref_tokens, ref_logits in zip(outs, tokens, logits, strict=True):
        assert out.token_ids == ref_tokens
        torch.testing.assert_close(torch.stack(llm.logits.pop(out.request_id)), ref_logits,
                                   atol=2e-4, rtol=1e-4)
    model = llm.engine.runner.model
    num_layers = len(model.model.layers)
    mtp = {info.name for info in model.mtp_tensors}
    if name not in MTP:
        assert not mtp
        return
    assert {n.split(".")[1] for n in mtp} == {str(num_layers)}
    assert {f"blk.{num_layers}.nextn.eh_proj.weight", f"blk.{num_layers}.nextn.enorm.weight",
            f"blk.{num_layers}.nextn.hnorm.weight", f"blk.{num_layers}.attn_q.weight"} <= mtp


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_quantized_file_matches_its_dequantized_weights(converted, qtype):
    """Weights kept in their blocks against the same file's weights as float32: only the
    kernels differ."""
    name, _, files, prompts, _, _ = converted
    ref, ref_outs = _run(files[qtype], prompts, dequantize=True)
    llm, outs = _run(files[qtype], prompts)
    for a, b in zip(outs, ref_outs, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.stack(llm.logits.pop(a.request_id)),
                                   torch.stack(ref.logits.pop(b.request_id)),
                                   atol=2e-3, rtol=1e-3)



def test_gemma4_tokenizer_matches_its_tokenizer_json(tmp_path):
    """Gemma 4's own vocabulary routine (tokenizer.ggml.model = "gemma4": SentencePiece-style
    pieces with BPE merges) read back gives the ids of the tokenizer.json it was written from,
    BOS first as the file says."""
    from tokenizers import Tokenizer

    from hybridkv.models.formats.gguf_tokenizer import (
        read_tokenizer_metadata,
        tokenizer_from_gguf,
    )

    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    vocab = llamacpp_convert.write_gemma_tokenizer(model_dir)
    build_tiny_model("gemma4_text", model_dir, vocab_size=vocab, vocab_size_per_layer_input=vocab)
    path = llamacpp_convert.convert(model_dir, tmp_path / "model.gguf", "f32", family_vocab=True)
    meta = read_tokenizer_metadata(str(path))
    assert meta["tokenizer.ggml.model"] == "gemma4"
    ours = tokenizer_from_gguf(meta, source=str(path))
    reference = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    texts = [llamacpp_convert.GEMMA_TEXT, "the  cat", "  leading", "new\n\nlines\n",
             "unseen: q\u00e9z \u4e16\u754c", "<bos>the<eos> end"]
    for text in texts:
        expected = reference.encode(text).ids
        assert ours.tokenizer.encode(text).ids == [ours.bos_token_id, *expected], text
        assert ours.tokenizer.decode(expected) == reference.decode(expected)
