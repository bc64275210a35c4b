"""The scheduler against a real KVCacheManager and a fake model (no torch)."""

from hybridkv.kv.manager import KVCacheManager
from hybridkv.sched.request import Request
from hybridkv.sched.sampling import SamplingParams
from hybridkv.sched.scheduler import Scheduler, SchedulerConfig
from tests.kv.toy import full, sliding, toy_config


def make(num_pages=40, budget=8, max_seqs=8, **kw):
    kv = KVCacheManager(toy_config(full(), sliding(8), num_pages=num_pages), max_model_len=64)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                     max_model_len=64, **kw), kv)


def request(rid, n, max_tokens=4):
    first = 100 * (ord(rid) - ord("a") + 1)  # requests share no prefix
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens),
                   hash_block_size=4)


def step(s, token=7):
    out = s.schedule()
    s.update_from_output(out, {rid: token for rid in out.num_scheduled_tokens})
    return out


def test_one_token_budget_split_between_decodes_and_prompt_chunks():
    s = make(budget=8)
    s.add_request(request("a", 10))
    s.add_request(request("b", 5))
    out = step(s)
    # a's prompt takes the whole budget in a chunk; b waits.
    assert out.num_scheduled_tokens == {"a": 8}
    assert out.new_requests[0].block_ids == [[1, 2], [3, 4]]
    out = step(s)
    # a finishes its prompt (2 tokens) and samples; b gets the remaining 6 (all 5).
    assert out.num_scheduled_tokens == {"a": 2, "b": 5}
    assert out.cached_requests[0].new_block_ids == [[5], [6]]
    assert s.requests["a"].output_token_ids == [7]
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    # a's new token is sent as a diff, not its whole history.
    assert out.cached_requests[0].new_token_ids == [7]


def test_a_shared_prefix_is_not_recomputed():
    s = make(budget=64)
    s.add_request(request("a", 10))
    step(s)
    s.add_request(Request("c", s.requests["a"].prompt_token_ids[:8] + [1, 2],
                          SamplingParams(), hash_block_size=4))
    out = step(s)
    assert out.num_scheduled_tokens["c"] == 2
    assert out.new_requests[0].num_computed_tokens == 8


def test_without_chunked_prefill_a_long_prompt_waits_for_a_budget_that_fits():
    s = make(budget=8, enable_chunked_prefill=False)
    s.add_request(request("a", 10))
    assert step(s).num_scheduled_tokens == {}


def test_memory_pressure_preempts_the_latest_admitted_request():
    # 6 usable pages; a and b (8 tokens each) take 2 blocks per group = all 8 blocks...
    s = make(num_pages=9, budget=64)
    s.add_request(request("a", 8, max_tokens=10))
    s.add_request(request("b", 8, max_tokens=10))
    out = step(s)
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    out = step(s)  # 9 tokens each: a needs a third block; b, the latest, is preempted
    assert out.preempted_request_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    assert s.waiting[0].request_id == "b" and s.num_preemptions == 1
    assert s.requests["b"].num_computed_tokens == 0
    s.kv.check_integrity()


def prioritized(rid, n, priority, arrival):
    req = request(rid, n, max_tokens=10)
    req.priority, req.arrival_index = priority, arrival
    return req


def test_priority_policy_admits_and_preempts_by_priority():
    s = make(num_pages=9, budget=64, policy="priority")
    s.add_request(prioritized("a", 8, priority=5, arrival=0))
    s.add_request(prioritized("b", 8, priority=1, arrival=1))
    s.add_request(prioritized("c", 4, priority=9, arrival=2))
    out = step(s)
    # b (priority 1) is admitted before a; c waits behind them (no memory left).
    assert [n.request_id for n in out.new_requests] == ["b", "a"]
    out = step(s)  # both need a third block: a, the lowest priority, is preempted
    assert out.preempted_request_ids == {"a"}
    assert out.num_scheduled_tokens == {"b": 1}
    assert [r.request_id for r in s.waiting] == ["a", "c"]
    s.kv.check_integrity()


def test_a_preempted_request_already_scheduled_this_step_gives_its_budget_back():
    s = make(num_pages=11, budget=64, policy="priority")  # 10 usable blocks
    s.add_request(prioritized("a", 8, priority=9, arrival=0))
    step(s)  # a alone: 2 + 2 blocks
    s.add_request(prioritized("b", 8, priority=1, arrival=1))
    out = step(s)  # a's 9th token takes a third block per group; b is admitted: 10 blocks
    assert [n.request_id for n in out.new_requests] == ["b"]
    assert [r.request_id for r in s.running] == ["a", "b"]
    out = step(s)
    # a is scheduled first (it fits), then b's 9th token needs two blocks: the victim is a,
    # already in this step's output, which must forget it.
    assert out.preempted_request_ids == {"a"}
    assert out.num_scheduled_tokens == {"b": 1}
    assert [c.request_id for c in out.cached_requests] == ["b"]
    assert "a" in out.finished_request_ids
    s.kv.check_integrity()


def test_unknown_policy():
    import pytest

    with pytest.raises(ValueError, match="unknown scheduling policy 'lifo'"):
        SchedulerConfig(policy="lifo")
