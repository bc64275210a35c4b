"""Structured output in the engine, on a small demo Llama (random weights: without the mask
its text is noise, so every valid output below is the mask's doing): each kind of spec,
every sampling mode, n > 1, preemption, a mixed batch, a compile that fails or is slow."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import pytest

torch = pytest.importorskip("torch")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.sched.structured import StructuredOutput  # noqa: E402
from tests.models.tiny import planner_minimum  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
PROMPTS = ["the quick brown fox", "hello there", "once upon a time"]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from hybridkv.models.demo import demo_shape, write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("structured") / "demo", "llama",
                            demo_shape("small"))


@pytest.fixture(scope="module")
def llm(demo_dir):
    return LLM(str(demo_dir), dtype="float32", max_model_len=256, kv_cache_memory="8MiB")


def constrained(max_tokens: int = 80, **kwargs: object) -> SamplingParams:
    spec = {k: kwargs.pop(k) for k in list(kwargs) if k in (
        "json_schema", "json_object", "regex", "choice", "grammar")}
    return SamplingParams(max_tokens=max_tokens, structured_output=spec, **kwargs)


def test_each_kind_of_spec_is_followed(llm):
    # Any object may go on forever: a bias towards "}" closes it where the grammar allows.
    close = llm.engine.tokenizer.token_to_id("}")
    specs = [dict(json_schema=SCHEMA), dict(json_object=True, logit_bias={close: 20}),
             dict(regex=r"[0-9]{3}-[a-z]{2,4}"), dict(choice=["yes", "no", "maybe so"]),
             dict(grammar='root ::= "(" ("x" | "y")+ ")"')]
    outs = llm.generate(PROMPTS[:1] * len(specs), [constrained(**s) for s in specs])
    assert [o.finish_reason for o in outs] == ["stop"] * len(specs)
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    assert isinstance(json.loads(outs[1].text), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outs[2].text)
    assert outs[3].text in ("yes", "no", "maybe so")
    assert re.fullmatch(r"\([xy]+\)", outs[4].text)
    # Without the mask the same model writes no JSON at all.
    [free] = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=40))
    with pytest.raises(ValueError):
        json.loads(free.text)


@pytest.mark.parametrize("sampling", [
    dict(temperature=1.0, seed=1), dict(temperature=0.8, top_k=20, seed=2),
    dict(temperature=1.2, top_p=0.9, min_p=0.05, seed=3),
    dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3),
    dict(temperature=1.0, seed=4, n=3)], ids=["temp", "top_k", "top_p_min_p", "penalties",
                                              "n3"])
def test_every_sampling_mode_stays_in_the_schema(llm, sampling):
    prompts = PROMPTS[:1] if "n" in sampling else PROMPTS
    outs = llm.generate(prompts, constrained(json_schema=SCHEMA, **sampling))
    assert len(outs) == len(prompts) * sampling.get("n", 1)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    if sampling.get("n"):  # each sample its own matcher: they differ
        assert len({o.text for o in outs}) > 1


def test_logit_bias_cannot_bring_back_a_masked_token(llm):
    # Token 500 is past the tokenizer's vocabulary (the model pads to 512): never text.
    digit = llm.engine.tokenizer.token_to_id("7")
    assert llm.engine.tokenizer.get_vocab_size() < 500 < llm.engine.vocab_size
    [out] = llm.generate(PROMPTS[:1], constrained(regex="[a-c]{5}",
                                                  logit_bias={500: 100, digit: 100}))
    assert out.finish_reason == "stop" and re.fullmatch("[a-c]{5}", out.text)
    # An allowed token the bias favours is chosen.
    a = llm.engine.tokenizer.token_to_id("a")
    [out] = llm.generate(PROMPTS[:1], constrained(regex="[a-c]{5}", logit_bias={a: 100}))
    assert out.text == "aaaaa"


def test_logprobs_are_the_models_own(llm):
    [out] = llm.generate(PROMPTS[:1], constrained(choice=["yes", "no"], logprobs=3))
    assert out.text in ("yes", "no")
    for entry in out.logprobs:
        assert all(lp > float("-inf") for lp in entry.values())


def test_free_rows_are_unchanged_by_constrained_neighbours(llm):
    free = SamplingParams(max_tokens=24)
    alone = llm.generate(PROMPTS, free)
    mixed = llm.generate(PROMPTS * 2, [free] * 3 + [constrained(json_schema=SCHEMA)] * 3)
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]
    for out in mixed[3:]:
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_a_preempted_request_resumes_its_grammar(demo_dir, llm):
    params = constrained(max_tokens=60, json_schema=SCHEMA)
    prompts = [p * 4 for p in PROMPTS] * 2
    expected = [o.text for o in llm.generate(prompts, params)]
    budget = planner_minimum(demo_dir, max_model_len=256, batch=64)
    tight = LLM(str(demo_dir), dtype="float32", max_model_len=256, kv_cache_memory=budget,
                max_num_batched_tokens=64)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    # Recomputed, never re-fed: the grammar would refuse a repeated token.
    assert [o.text for o in outs] == expected
    for out in outs:
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), SCHEMA)
    assert any(o.finish_reason == "stop" for o in outs)


def test_a_grammar_that_cannot_compile_fails_alone(llm):
    outs = llm.generate(PROMPTS[:3], [
        constrained(regex="a(b"), constrained(json_schema={"type": "array",
                                                           "uniqueItems": True}),
        SamplingParams(max_tokens=5)])
    assert [o.finish_reason for o in outs] == ["error", "error", "length"]
    assert "unclosed group" in outs[0].error and "\n" not in outs[0].error
    assert "uniqueItems" in outs[1].error


def test_a_slow_compile_holds_only_its_own_request(llm):
    """A compile still running keeps its request waiting; the others run to the end."""
    engine = llm.engine
    spec = StructuredOutput(choice=["slow"])
    pending: Future = Future()
    with engine.structured._lock:
        engine.structured._cache[spec.key] = pending
    engine.add_request("slow", "a", SamplingParams(max_tokens=8, structured_output=spec))
    engine.add_request("fast", "b", SamplingParams(max_tokens=4))
    finished = {}
    for _ in range(20):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if "fast" in finished:
            break
    assert "fast" in finished and "slow" not in finished
    assert engine.scheduler.requests["slow"].status.value == "waiting"
    pending.set_result(engine.structured.compile(StructuredOutput(choice=["slow!"])).result()
                       .deep_copy())
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["slow"].text == "slow!"
    with engine.structured._lock:
        del engine.structured._cache[spec.key]


@pytest.fixture
def counted_masks(monkeypatch):
    """Rows whose mask was computed, over every step."""
    from hybridkv.sched.structured.manager import StepGrammars

    rows: list[str] = []
    bitmask = StepGrammars.bitmask

    def counting(self, request_ids=None):
        rows.extend(self.request_ids if request_ids is None else request_ids)
        return bitmask(self, request_ids)

    monkeypatch.setattr(StepGrammars, "bitmask", counting)
    return rows


@pytest.mark.parametrize("path", ["blocked_head", "full_logits"])
def test_greedy_rows_compute_a_mask_only_when_their_best_token_is_refused(
        demo_dir, counted_masks, monkeypatch, path):
    # The masked argmax is the unmasked one whenever the grammar allows that token, so a
    # greedy row skips its mask then; the tokens are those of masking every row.
    from hybridkv.models.base import CausalLM
    from hybridkv.sched.structured.manager import StepGrammars
    from tests.hooks import record_logits

    if path == "blocked_head":  # the tiny head takes the blocked path (top candidates)
        monkeypatch.setattr(CausalLM, "BLOCKED_HEAD_WEIGHTS", 1)
        monkeypatch.setattr(CausalLM, "HEAD_BLOCK_ROWS", 48)
    options = dict(dtype="float32", max_model_len=256, kv_cache_memory="8MiB",
                   linear_kernel="torch")
    lazy = LLM(str(demo_dir), **options)
    if path == "full_logits":
        record_logits(lazy)  # a logits hook: the sampler gets every row's full logits
    specs = [dict(json_schema=SCHEMA), dict(regex=r"[0-9]{3}-[a-z]{2,4}"),
             dict(choice=["yes", "no", "maybe so"])]
    params = [constrained(**s) for s in specs] + [SamplingParams(max_tokens=12)]
    prompts = PROMPTS + PROMPTS[:1]
    got = lazy.generate(prompts, params)
    lazily_masked = len(counted_masks)
    sampled = sum(len(o.token_ids) for o in got[:3])
    assert 0 < lazily_masked < sampled

    counted_masks.clear()
    monkeypatch.setattr(StepGrammars, "allows", lambda self, rid, token: False)
    masked = LLM(str(demo_dir), **options).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in masked]
    assert len(counted_masks) == sampled  # every constrained row's mask, every step
    assert got[0].finish_reason == "stop"
    jsonschema.validate(json.loads(got[0].text), SCHEMA)
