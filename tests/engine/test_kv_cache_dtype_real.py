"""int8 and q4 KV pages on the real models (GGUF files installed from PyPI): the first
step's logits on SmolLM2-135M-Instruct stay within a stated bound of float32 pages (int8:
measured 0.32 on logits of magnitude ~40; q4: 1.29 of ~30); with float32, int8 and q4
pages, prefix hits (device, CPU and disk tier), chunked prefill and batching change no token
of eight ordinary requests on SmolLM2 and Gemma 3 270M, from their GGUF files and from the
float32 directories transformers writes from them (batch invariance, on the quantized and the
float linear kernels). Accuracy over a long text is `hybridkv bench kv-quant`'s
(docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.models.sources import real_model_path  # noqa: E402
from tests.hooks import record_logits  # noqa: E402

# The first step's logits are compared on a prompt whose greedy tokens win by >= 0.1 logits
# (a bound on logits, not on tokens); tokens are compared on ordinary prompts below.
PROMPT = ("The capital of France is Paris. The capital of Germany is Berlin. The capital of "
          "Italy is")
NAME = "smollm2-135m-instruct"


PARAMS = SamplingParams(temperature=0, max_tokens=12)


def _engine(**options) -> LLM:
    return _model_engine(NAME, **options)


def real_model_path_or_skip(name: str):
    try:
        return real_model_path(name)
    except ValueError as e:
        pytest.skip(str(e))


def _model_engine(name: str, **options) -> LLM:
    if not Path(name).is_dir():  # a real model's short name, not a float32 directory
        real_model_path_or_skip(name)
    return LLM(name, **{"kv_cache_memory": "64MiB", "max_model_len": 512, **options})


def _float32_directory(name: str, root) -> str:
    """The real model's GGUF dequantized by transformers and saved as a float32 Hugging Face
    directory (what a user who converts the file, or vLLM's CPU build, reads)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = real_model_path_or_skip(name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.hf_quantizer = None  # plain float32 weights, no GGUF quantization config
    del model.config.quantization_config
    model.save_pretrained(root)
    transformers.AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name).save_pretrained(root)
    return str(root)


@pytest.fixture(scope="module")
def float32_dirs(tmp_path_factory):
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            made[name] = _float32_directory(name, tmp_path_factory.mktemp(name))
        return made[name]
    return get


def _reference_and_quantized(prompt: str, kv_cache_dtype: str):
    """(float32 pages' first-step logits, the quantized engine, its 12 greedy tokens'
    output and their logits), each greedy step's top two at least 0.1 apart."""
    base = _engine()
    seen = record_logits(base)
    ref = base.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
    ref_logits = seen[ref.request_id][0]
    llm = _engine(kv_cache_dtype=kv_cache_dtype)
    seen = record_logits(llm)
    first = llm.generate([prompt], PARAMS)[0]
    logits = seen[first.request_id]
    gaps = [float(top.values[0] - top.values[1]) for top in (lg.topk(2) for lg in logits)]
    assert min(gaps) > 0.1
    return ref_logits, llm, first, logits


def test_int8_pages_on_the_real_model():
    ref_logits, llm, first, logits = _reference_and_quantized(PROMPT, "int8")
    assert float((logits[0] - ref_logits).abs().max()) < 1.0
    assert set(ref_logits.topk(5).indices.tolist()) == set(logits[0].topk(5).indices.tolist())


# Eight ordinary requests of a chat, fixed (none chosen for its tokens' margins), sharing a
# system prompt of two blocks and more, so later ones hit the earlier ones' blocks.
SYSTEM = ("You are a helpful assistant running on a small computer in a public library. "
          "Answer clearly and briefly, in plain words, and keep to the facts you are sure "
          "of. If a question is unclear, say what you would need to know. ")
QUESTIONS = [
    "What is the tallest mountain in Europe?",
    "Give me a short recipe for pancakes.",
    "Why do cats purr?",
    "Translate 'good morning' into French and Spanish.",
    "Write two lines of a poem about autumn rain.",
    "How many legs does a spider have?",
    "Explain what a prime number is to a child.",
    "Suggest a name for a small bakery by the sea.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _one_by_one(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma-3-270m"])
@pytest.mark.parametrize("weights", ["gguf", "float32"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "q4"])
def test_caching_changes_no_token(name, weights, kv_cache_dtype, float32_dirs, tmp_path):
    """Prefix hits (from the device, the CPU tier and, in a fresh engine, the disk tier),
    chunked prefill and batching give every request the tokens it gets alone without
    caching: with float32, int8 and q4 pages a token's K/V bytes do not depend on how its
    step was made (docs/engine.md)."""
    if weights == "float32":
        name = float32_dirs(name)
    prompts = [SYSTEM + q for q in QUESTIONS]
    options = {"kv_cache_dtype": kv_cache_dtype, "max_model_len": 256}
    alone = _one_by_one(_model_engine(name, enable_prefix_caching=False, **options), prompts)

    disk = f"{tmp_path / 'kv'}:64MiB"
    cached = _model_engine(name, kv_offload_cpu="64MiB", kv_offload_disk=disk,
                           kv_offload_store="fill", **options)
    outs = [cached.generate([p], GREEDY)[0] for p in prompts]
    assert sum(o.num_cached_tokens for o in outs[1:]) >= 7 * 32  # the system prompt's blocks
    assert [o.token_ids for o in outs] == alone
    cached.engine.runner.connector.flush()
    assert cached.reset_prefix_cache() is True  # the device cache's blocks: gone
    again = [cached.generate([p], GREEDY)[0] for p in prompts]
    assert sum(o.cached_tokens_by_tier["cpu"] for o in again) > 0
    assert [o.token_ids for o in again] == alone
    cached.close()
    # Another process's view: only the disk tier, all eight requests in one batch.
    fresh = _model_engine(name, kv_offload_disk=disk, **options)
    from_disk = fresh.generate(prompts, GREEDY)
    assert sum(o.cached_tokens_by_tier["disk"] for o in from_disk) >= 8 * 32
    assert [o.token_ids for o in from_disk] == alone
    fresh.close()

    chunked = _model_engine(name, enable_prefix_caching=False, max_num_batched_tokens=7,
                            **options)
    assert _one_by_one(chunked, prompts) == alone
    batched = _model_engine(name, **options)
    assert [o.token_ids for o in batched.generate(prompts, GREEDY)] == alone


# 40 tokens: two whole key groups that a hit reads from the pages, then an unfinished one.
PROMPT_Q4 = ("The capital of France is Paris. The capital of Germany is Berlin. The capital of "
             "Spain is Madrid. The capital of Portugal is Lisbon. The capital of Austria is "
             "Vienna. The capital of Italy is")


def test_q4_pages_on_the_real_model():
    ref_logits, llm, first, logits = _reference_and_quantized(PROMPT_Q4, "q4")
    assert float((logits[0] - ref_logits).abs().max()) < 2.0
    assert ref_logits.topk(2).indices.tolist() == logits[0].topk(2).indices.tolist()
    again = llm.generate([PROMPT_Q4], PARAMS)[0]
    assert again.num_cached_tokens >= 32
    assert again.token_ids == first.token_ids
    chunked = _engine(kv_cache_dtype="q4", max_num_batched_tokens=7,
                      enable_prefix_caching=False)
    assert chunked.generate([PROMPT_Q4], PARAMS)[0].token_ids == first.token_ids
