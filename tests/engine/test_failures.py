"""One request's failure never takes the engine down: it finishes with finish_reason
"error" and a message, its blocks are freed, its batch-mates' tokens are unchanged, and the
next call is served. A request that can never fit is refused the same way, after the engine
has retried past its own preemptions."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.config import EngineConfig  # noqa: E402
from hybridkv.engine.build import EngineParts  # noqa: E402
from hybridkv.engine.engine import LLMEngine  # noqa: E402
from hybridkv.kv.manager import KVCacheManager  # noqa: E402
from hybridkv.kv.plan import plan_kv_cache  # noqa: E402
from hybridkv.kv.spec import FullAttentionSpec  # noqa: E402
from hybridkv.sched.scheduler import Scheduler, SchedulerConfig, SchedulerOutput  # noqa: E402
from hybridkv.worker.model_runner import RunnerOutput  # noqa: E402
from tests.models.tiny import build_tiny_model  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9] * 4, [11, 12, 13], [40, 41, 42, 43, 44, 45, 46] * 3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("gemma3", tmp_path_factory.mktemp("gemma3"))


def _llm(model_dir, **options):
    return LLM(str(model_dir), dtype="float32", max_model_len=128, kv_cache_memory="4MiB",
               **options)


def _books_clean(llm):
    kv = llm.engine.kv_manager
    kv.pool.check_integrity()
    assert kv.usage == 0.0
    assert not llm.engine.scheduler.has_unfinished


def test_a_failing_sampler_row_errors_only_its_request(model_dir, monkeypatch):
    llm = _llm(model_dir)
    greedy = SamplingParams(max_tokens=8)
    expected = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
    sampler = llm.engine.runner.sampler
    real = sampler._sample_row

    def broken(logits, rid, p):
        if p.seed == 7:  # the victim: a sampled (non-greedy) request
            raise RuntimeError("injected failure")
        return real(logits, rid, p)

    monkeypatch.setattr(sampler, "_sample_row", broken)
    victim = SamplingParams(max_tokens=8, temperature=0.8, seed=7)
    outs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [greedy, victim, greedy])
    assert outs[1].finish_reason == "error"
    assert "injected failure" in outs[1].error and outs[1].token_ids == []
    assert [outs[0].token_ids, outs[2].token_ids] == [expected[0], expected[2]]
    assert outs[0].finish_reason == outs[2].finish_reason == "length"
    _books_clean(llm)
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == expected


def test_a_failing_forward_errors_its_step_and_poisons_no_cache(model_dir, monkeypatch):
    llm = _llm(model_dir)
    greedy = SamplingParams(max_tokens=6)
    expected = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
    llm.engine.kv_manager.reset_prefix_cache()
    model = llm.engine.runner.model
    real = model.forward
    calls = {"n": 0}

    def broken_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device fell over")
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "forward", broken_once)
    outs = llm.generate(PROMPTS, greedy)
    assert all(o.finish_reason == "error" and "device fell over" in o.error for o in outs)
    _books_clean(llm)
    # The failed step hashed blocks whose KV was never written: a hit on them would give
    # wrong tokens. The same prompts again must equal the first run.
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == expected


def test_bad_values_are_refused_at_admission_and_nothing_stays_queued(model_dir):
    llm = _llm(model_dir)
    for bad in [{"temperature": float("nan")}, {"top_k": 2.5}, {"logprobs": 2.5},
                {"stop": [5]}, {"seed": 2**70, "temperature": 0.5}]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            llm.generate([[5, 6], [7, 8]], [SamplingParams(), bad])
        assert not llm.engine.scheduler.has_unfinished
    [tiny] = llm.generate([[5, 6]], SamplingParams(temperature=1e-45, max_tokens=4))
    [greedy] = llm.generate([[5, 6]], SamplingParams(max_tokens=4))
    assert tiny.token_ids == greedy.token_ids


# ---------------------------------------------------------------- never fitting, with fakes
class CountingRunner:
    """A stand-in model runner: every request whose known tokens are all computed samples
    token 3. What is tested here is the engine loop, not the model."""

    def __init__(self) -> None:
        self.num_tokens: dict[str, int] = {}

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        for new in out.new_requests:
            self.num_tokens[new.request_id] = len(new.token_ids)
        for cached in out.cached_requests:
            self.num_tokens[cached.request_id] += len(cached.new_token_ids)
        sampled = {}
        for new in out.new_requests:
            if new.num_computed_tokens + out.num_scheduled_tokens[new.request_id] == \
                    self.num_tokens[new.request_id]:
                sampled[new.request_id] = 3
        for cached in out.cached_requests:
            if cached.num_computed_tokens + out.num_scheduled_tokens[cached.request_id] == \
                    self.num_tokens[cached.request_id]:
                sampled[cached.request_id] = 3
        return RunnerOutput(sampled, {})


def _fake_engine(num_blocks: int, *, max_model_len: int = 64) -> LLMEngine:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype="fp32")
    page = spec.page_size_bytes
    # strict=False: a budget below one request of max_model_len (the planner would refuse).
    plan = plan_kv_cache({"layer": spec}, (num_blocks + 1) * page, max_model_len=max_model_len,
                         max_num_batched_tokens=8, max_large_page_bytes=page, strict=False)
    kv = KVCacheManager(plan.config, max_model_len=max_model_len)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_model_len=max_model_len),
                          kv)
    parts = EngineParts(scheduler=scheduler, runner=CountingRunner(), plan=plan,
                        max_model_len=max_model_len, vocab_size=16)
    return LLMEngine(parts, EngineConfig())


def _run(engine: LLMEngine) -> dict[str, object]:
    finished = {}
    for _ in range(500):
        if not engine.has_unfinished:
            return finished
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    raise AssertionError("the engine did not finish its requests")


def test_a_request_that_never_fits_is_refused_and_the_others_finish():
    engine = _fake_engine(num_blocks=4)  # 16 tokens of KV in all
    engine.add_request("small", [1] * 5, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("huge", [1] * 30, SamplingParams(max_tokens=3))
    engine.add_request("after", [1] * 6, SamplingParams(max_tokens=4))
    done = _run(engine)
    assert done["huge"].finish_reason == "error"
    assert "does not fit in the KV cache even alone" in done["huge"].error
    assert done["small"].token_ids == [3, 3, 3] and done["after"].token_ids == [3] * 4
    engine.kv_manager.pool.check_integrity()
    assert engine.kv_manager.usage == 0.0


def test_a_lone_request_that_preempts_itself_is_retried_then_refused():
    """It is admitted (its prompt fits), outgrows the cache while alone and preempts itself:
    that step schedules nothing and the engine must retry, not abort. Re-admitted with its
    outputs as prompt it no longer fits at all, and only then is it refused."""
    engine = _fake_engine(num_blocks=4)  # 16 tokens of KV in all
    engine.add_request("grows", [1] * 10, SamplingParams(max_tokens=20, ignore_eos=True))
    retried = False
    done = {}
    for _ in range(200):
        if not engine.has_unfinished:
            break
        outs = engine.step()
        request = engine.scheduler.requests.get("grows")
        if request is not None and request.status.value == "preempted":
            assert outs == []  # the step it preempted itself in: nothing lost, nothing raised
            retried = True
        done.update({o.request_id: o for o in outs if o.finished})
    assert retried and engine.scheduler.num_preemptions == 1
    assert done["grows"].finish_reason == "error"
    assert "does not fit in the KV cache even alone" in done["grows"].error
    assert done["grows"].token_ids == [3] * 7  # 16 tokens computed, the 17th sampled
    engine.kv_manager.pool.check_integrity()
    assert engine.kv_manager.usage == 0.0
