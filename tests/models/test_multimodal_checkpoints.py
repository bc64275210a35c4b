"""Full multimodal checkpoints (Gemma 3, Llama 4, Gemma 4, Qwen3.5) run their text model:
the text weights are found under either layout transformers writes (`language_model.model.*`
or `model.language_model.*`), the vision towers and projectors are skipped, and greedy
tokens and logits on text prompts equal the full transformers model's."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridkv import LLM, SamplingParams  # noqa: E402
from tests.hooks import record_logits  # noqa: E402
from tests.models.tiny import COMMON  # noqa: E402

TEXT = {**COMMON, "num_hidden_layers": 2}
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
NUM_NEW = 8


def gemma3():
    return transformers.Gemma3Config(
        text_config={**TEXT, "model_type": "gemma3_text", "sliding_window": 16,
                     "query_pre_attn_scalar": 16},
        vision_config={**VISION, "model_type": "siglip_vision_model", "image_size": 32,
                       "patch_size": 8}, mm_tokens_per_image=4)


def llama4():
    return transformers.Llama4Config(
        text_config={**TEXT, "attention_chunk_size": 16, "intermediate_size_mlp": 128,
                     "num_local_experts": 2, "num_experts_per_tok": 1,
                     "interleave_moe_layer_step": 2, "floor_scale": 8},
        vision_config={**VISION, "image_size": 32, "patch_size": 8, "vision_output_dim": 32,
                       "projector_input_dim": 32, "projector_output_dim": 32})


def gemma4():
    return transformers.Gemma4Config(
        text_config={**TEXT, "model_type": "gemma4_text", "sliding_window": 16,
                     "layer_types": ["sliding_attention", "full_attention"],
                     "global_head_dim": 32, "hidden_size_per_layer_input": 8,
                     "vocab_size_per_layer_input": 256},
        vision_config={**VISION, "num_key_value_heads": 2, "head_dim": 16}, audio_config=None)


def qwen3_5():
    return transformers.Qwen3_5Config(
        text_config={**TEXT, "num_hidden_layers": 4, "linear_num_key_heads": 2,
                     "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                     "linear_value_head_dim": 16},
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=64))


MODELS = {
    "gemma3": (gemma3, "Gemma3ForConditionalGeneration", "language_model.model."),
    "llama4": (llama4, "Llama4ForConditionalGeneration", "language_model.model."),
    "gemma4": (gemma4, "Gemma4ForConditionalGeneration", "model.language_model."),
    "qwen3_5": (qwen3_5, "Qwen3_5ForConditionalGeneration", "model.language_model."),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_text_model_of_a_full_multimodal_checkpoint(name, tmp_path):
    from safetensors import safe_open

    make_config, model_cls, text_prefix = MODELS[name]
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(make_config()).eval()
    with torch.no_grad():  # norms start at constants; noise so that skipping one shows
        for tensor in hf.state_dict().values():
            if tensor.is_floating_point() and bool((tensor == tensor.flatten()[0]).all()):
                tensor.add_(0.1 * torch.randn(tensor.shape))
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = list(f.keys())  # noqa: SIM118
    # The checkpoint really holds a tower beside the text model, in the layout named.
    assert any(n.startswith(text_prefix) for n in names)
    assert any(("vision" in n or "visual" in n) and not n.startswith(text_prefix)
               for n in names)

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 256, (n,), generator=gen).tolist() for n in (23, 40)]
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, kv_cache_memory="4MiB")
    llm.logits = record_logits(llm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NUM_NEW))
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW, do_sample=False,
                          eos_token_id=None, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
        assert out.token_ids == ref.sequences[0, len(prompt):].tolist()
        torch.testing.assert_close(torch.stack(llm.logits.pop(out.request_id)),
                                   torch.stack([step[0] for step in ref.logits]),
                                   atol=2e-4, rtol=1e-4)
