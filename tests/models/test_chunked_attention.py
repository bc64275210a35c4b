"""Llama 4 style chunked attention with a chunk that is not a multiple of the block size
(20 on blocks of 16): the block a chunk boundary cuts stays with the later chunk, and outputs
equal transformers with prefix hits, small prefill chunks and preemption."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybridkv import SamplingParams  # noqa: E402
from tests.models.test_against_transformers import (  # noqa: E402
    NUM_NEW,
    check,
    check_with_preemption,
    hf_reference,
    run,
)
from tests.models.tiny import build_tiny_model  # noqa: E402

CHUNK = 20
PROMPT_LENS = (45, 19, 33, 41)  # across chunk edges (20, 40) and block edges (16, 32)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    model_dir = build_tiny_model("llama4_text", tmp_path_factory.mktemp("llama4_c20"),
                                 attention_chunk_size=CHUNK)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return (model_dir, prompts, *hf_reference(model_dir, prompts))


def test_a_chunk_that_cuts_a_block_equals_transformers(reference):
    model_dir, prompts, tokens, logits = reference
    llm, outs = run(model_dir, prompts, block_size=16)
    kinds = {g.spec.kind for g in llm.engine.plan.config.groups}
    assert "chunked_local" in kinds
    check(llm, outs, tokens, logits)
    # Again: prompts that share their start now hit the prefix cache, chunk state included.
    again = llm.generate(prompts, SamplingParams(max_tokens=NUM_NEW))
    assert sum(o.num_cached_tokens for o in again) > 0
    check(llm, again, tokens, logits)


def test_prefill_chunks_of_nine(reference):
    model_dir, prompts, tokens, logits = reference
    llm, outs = run(model_dir, prompts, block_size=16, max_num_batched_tokens=9)
    check(llm, outs, tokens, logits)


def test_preemption(reference):
    model_dir, prompts, tokens, logits = reference
    check_with_preemption(("llama4_text", model_dir, prompts, tokens, logits), block_size=16)
