"""Batch invariance on a real model (SmolLM2-135M-Instruct, its Q4_1 GGUF from PyPI; and a
tiny random float32 model, for the float linear kernel): the bytes a token's K/V gets in
every layer's pages do not depend on the other tokens of its step or chunk nor on where
its prefix came from. One prompt's page rows are read back right
after each write: alone, in chunks of 7, in a batch with three other requests, and after a
prefix hit on another prompt's blocks; every row must be byte-equal to the alone run's,
for float32, int8 and q4 pages (docs/engine.md, "Batch invariance", states the guarantee and
its limits)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.models.sources import real_model_path  # noqa: E402

NAME = "smollm2-135m-instruct"
SYSTEM = ("You are a careful assistant. Answer in plain words, briefly and truthfully, and "
          "say so when you do not know. ")
PROMPT = SYSTEM + "Why is the sky blue? Explain it in two sentences."
OTHERS = [SYSTEM + "What is two plus two?", "Write a haiku about the sea.",
          "List three prime numbers and say why each is prime."]
# ignore_eos: every run writes its decode steps' K/V (on some CPUs the int8 run's first
# token is EOS, a near tie: -2.388 against -2.390 on a Xeon with AVX-512 FP16)
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module", params=["gguf", "float32"])
def model(request, tmp_path_factory) -> str:
    """The real SmolLM2 GGUF, or a tiny random Llama directory in float32."""
    if request.param == "gguf":
        try:
            return str(real_model_path(NAME))
        except ValueError as e:
            pytest.skip(str(e))
    from hybridkv.models.demo import demo_shape, write_demo_model

    return str(write_demo_model(tmp_path_factory.mktemp("llama"), "llama",
                                demo_shape("small", layers=4)))


def _engine_with(model: str, kv_cache_dtype: str, **options) -> LLM:
    return LLM(model, kv_cache_memory="64MiB", max_model_len=512,
               kv_cache_dtype=kv_cache_dtype, **options)


class PageRows:
    """Every K/V row a request's pages hold when it finishes (its blocks read before they
    are freed, whichever path wrote them: prefill, the one-call decode layers, another
    request's prefill before a hit): {(layer, position): bytes}, per request id."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.rows: dict[str, dict[tuple[int, int], bytes]] = {}
        manager, runner = llm.engine.kv_manager, llm.engine.runner
        [group] = llm.engine.plan.config.groups  # Llama: one full-attention group
        free = manager.free

        def reading(request, **kwargs):
            blocks = manager.get_block_ids(request.request_id)[0]
            rows = {}
            for layer, name in enumerate(group.layer_names):
                view = runner.kv_caches[name]  # [pages, per_page, 2, block, Hk, row]
                per_page, size = view.shape[1], view.shape[3]
                for pos in range(request.num_computed_tokens):
                    b = blocks[pos // size]
                    row = view[b // per_page, b % per_page, :, pos % size]
                    rows[(layer, pos)] = row.contiguous().view(torch.uint8).numpy().tobytes()
            self.rows[request.request_id] = rows
            free(request, **kwargs)

        manager.free = reading

    def run(self, prompts: list[str]) -> tuple[list[dict[tuple[int, int], bytes]], list]:
        outputs = self.llm.generate(prompts, PARAMS)
        return [self.rows[o.request_id] for o in outputs], outputs


@pytest.mark.parametrize("kv_cache_dtype,activations", [
    ("auto", "float32"), ("int8", "float32"), ("q4", "float32"), ("auto", "int8"),
    ("q4", "int8")])
def test_page_bytes_alone_chunked_batched_and_after_a_hit(model, kv_cache_dtype, activations):
    """float32 activations, and 8-bit ones (llama.cpp's arithmetic, quant_activations="int8":
    the GGUF's quantized products at every row count; the float32 model has none)."""
    if activations == "int8" and not model.endswith(".gguf"):
        pytest.skip("8-bit activations apply to quantized weights (the GGUF) only")
    def _engine(model: str, kv_cache_dtype: str, **options) -> LLM:
        return _engine_with(model, kv_cache_dtype, quant_activations=activations, **options)

    plain = {"enable_prefix_caching": False}
    [alone], [ref] = PageRows(_engine(model, kv_cache_dtype, **plain)).run([PROMPT])
    # the prompt and the generated tokens whose K/V was written, decode steps' included
    positions = {p for _, p in alone}
    assert positions == set(range(len(positions)))
    assert len(positions) >= len(ref.prompt_token_ids) + PARAMS.max_tokens - 2
    [chunked], [out] = PageRows(_engine(model, kv_cache_dtype, **plain,
                                        max_num_batched_tokens=7)).run([PROMPT])
    [batched, *_], outs = PageRows(_engine(model, kv_cache_dtype, **plain)).run(
        [PROMPT, *OTHERS])
    assert outs[0].token_ids == out.token_ids == ref.token_ids
    assert chunked.keys() == alone.keys() and batched.keys() == alone.keys()
    for key in alone:
        assert chunked[key] == alone[key], ("chunks of 7", key)
        assert batched[key] == alone[key], ("batch of 4", key)

    # A prefix hit: the system prompt's blocks come from another request's prefill (a prompt
    # of another length, so its rows were computed in a step of another shape).
    pages = PageRows(_engine(model, kv_cache_dtype))
    pages.run([OTHERS[0]])
    [hit], [again] = pages.run([PROMPT])
    assert again.num_cached_tokens >= 16
    assert again.token_ids == ref.token_ids
    assert hit.keys() == alone.keys()
    for key in alone:
        assert hit[key] == alone[key], ("after a hit", key)
