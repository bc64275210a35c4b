"""A full Inkling 2 checkpoint (text decoder + vision tower, `model_type` inkling2): its text
model runs, the tower skipped, with transformers' greedy tokens (the multimodal model given
text alone), also from a prefix hit."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridkv import SamplingParams  # noqa: E402
from tests.models.test_against_transformers import (  # noqa: E402
    NUM_NEW,
    check,
    greedy_reference,
    run,
)
from tests.models.tiny import ARCHS, COMMON  # noqa: E402


def test_full_checkpoint_runs_its_text_model(tmp_path):
    config = transformers.Inkling2Config(
        text_config={**COMMON, **ARCHS["inkling2"][2]},
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           text_hidden_size=COMMON["hidden_size"], projection_hidden_dim=32,
                           intermediate_size=64))
    torch.manual_seed(0)
    model = transformers.Inkling2ForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # zero-initialised taps and queries get noise, as in tiny.py
        for tensor in model.state_dict().values():
            if tensor.is_floating_point() and bool((tensor == tensor.flatten()[0]).all()):
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=gen))
    model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path)
    prompts = [torch.randint(4, 256, (n,), generator=gen).tolist() for n in (40, 23)]
    tokens, logits = greedy_reference(model, prompts)
    llm, outs = run(tmp_path, prompts)
    check(llm, outs, tokens, logits)
    again = llm.generate(prompts[:1], SamplingParams(max_tokens=NUM_NEW))
    check(llm, again, tokens[:1], logits[:1])
    assert llm.engine.kv_manager.stats.num_hit_tokens == 32
