"""Requests that arrive together with a shared prefix compute it once: a waiting request
whose prompt shares a prefix with one being prefilled hits it once admitted, in a state
group (Mamba) too: the prefilling request saves a checkpoint where the prompts part."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.kv.manager import KVCacheManager
from hybridkv.kv.shared_prompts import SharedPrompts
from hybridkv.sched.request import Request, RequestStatus
from hybridkv.sched.sampling import SamplingParams
from hybridkv.sched.scheduler import Scheduler, SchedulerConfig
from tests.kv.toy import BLOCK, full, mamba, request, sliding, toy_config

SYSTEM = list(range(1000, 1026))  # 26 tokens: 6 whole blocks of 4, then 2 more


def make(*specs, budget=8, branch_points=True, num_pages=200):
    # One block of prompt tail (toy prompts are a few blocks of 4): the only state
    # checkpoint where the users' prompts part is the branch point.
    kv = KVCacheManager(toy_config(*specs, num_pages=num_pages), max_model_len=256,
                        checkpoint_branch_points=branch_points, checkpoint_tail=1)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8,
                                     max_model_len=256), kv)


def user(rid: str, n: int = 5, max_tokens: int = 2) -> Request:
    own = [100 * (ord(rid) - ord("a") + 1) + i for i in range(n)]
    return Request(rid, SYSTEM + own, SamplingParams(max_tokens=max_tokens),
                   hash_block_size=BLOCK)


def run(s: Scheduler) -> tuple[dict[str, int], dict[str, int]]:
    """Steps until every request is done: (tokens computed, cached tokens at admission)."""
    computed: dict[str, int] = {}
    cached: dict[str, int] = {}
    for _ in range(200):
        if not s.has_unfinished:
            break
        out = s.schedule()
        for new in out.new_requests:
            cached.setdefault(new.request_id, new.num_computed_tokens)
        for rid, n in out.num_scheduled_tokens.items():
            computed[rid] = computed.get(rid, 0) + n
        done = [r for r in s.update_from_output(out, {rid: 7 for rid in
                                                      out.num_scheduled_tokens})
                if len(r.output_token_ids) >= r.sampling_params.max_tokens]
        s.finish(done, RequestStatus.FINISHED_LENGTH)
    assert not s.has_unfinished
    return computed, cached


def test_requests_arriving_together_compute_their_shared_prefix_once():
    for specs in [(full(),), (full(), sliding(8)), (full(), mamba())]:
        s = make(*specs)
        for rid in "abcd":
            s.add_request(user(rid))
        computed, cached = run(s)
        # a computes the 24 shared tokens of whole blocks; b, c, d hit them (with a state
        # group: at the checkpoint a saved where they leave its prompt) and compute the rest.
        assert cached == {"a": 0, "b": 24, "c": 24, "d": 24}, specs
        assert sum(computed.values()) == 31 + 3 * 7 + 4 * 1, specs  # + a decode each

    # Without branch points, attention groups still hit (a's blocks are cached as it
    # computes them), but a state group has no checkpoint where b, c and d leave a's
    # prompt: they recompute it.
    off = make(full(), mamba(), branch_points=False)
    for rid in "abcd":
        off.add_request(user(rid))
    computed, cached = run(off)
    assert cached["b"] == 0
    assert sum(computed.values()) > 31 + 3 * 7 + 4 * 1


def test_a_late_request_waits_for_the_running_prefill_and_hits_it():
    s = make(full(), mamba(), budget=8)
    s.add_request(user("a"))
    out = s.schedule()  # a computes its first 8 tokens
    s.update_from_output(out, {})
    s.add_request(user("b"))
    seen_b = []
    for _ in range(6):
        out = s.schedule()
        if "b" in out.num_scheduled_tokens:
            seen_b.append(out.num_scheduled_tokens["b"])
            new = next(n for n in out.new_requests if n.request_id == "b")
            assert new.num_computed_tokens == 24  # the checkpoint a saved for it
            break
        s.update_from_output(out, {rid: 7 for rid in out.num_scheduled_tokens})
    assert seen_b, "b was never admitted"


def test_a_request_left_behind_by_one_that_stops_running_computes_the_prefix_itself():
    s = make(full(), mamba(), budget=8)
    s.add_request(user("a", max_tokens=50))
    s.add_request(user("b"))
    out = s.schedule()
    s.update_from_output(out, {})
    assert s.requests["b"].status == RequestStatus.WAITING
    s.finish([s.requests["a"]], RequestStatus.FINISHED_ABORTED)  # gone before the prefix
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b": 8}
    assert out.new_requests[0].num_computed_tokens == 0


def test_only_state_groups_with_branch_points_keep_the_index():
    assert make(full(), mamba())._prefilling is not None
    assert make(full(), sliding(8))._prefilling is None  # attention hits need no checkpoint
    assert make(full(), mamba(), branch_points=False)._prefilling is None
    kv = KVCacheManager(toy_config(full(), mamba(), num_pages=100), max_model_len=256,
                        enable_caching=False)
    assert Scheduler(SchedulerConfig(max_model_len=256), kv)._prefilling is None


@st.composite
def prompt_sets(draw: st.DrawFn) -> list[list[int]]:
    prompts: list[list[int]] = []
    for _ in range(draw(st.integers(1, 6))):
        prefix: list[int] = []
        if prompts and draw(st.booleans()):
            base = draw(st.sampled_from(prompts))
            prefix = base[:draw(st.integers(0, len(base)))]
        prompts.append(prefix + draw(st.lists(st.integers(1, 3), min_size=1, max_size=14)))
    return prompts


@settings(max_examples=150, deadline=None)
@given(prompt_sets(), st.data())
def test_longest_match_is_the_longest_shared_whole_block_prefix(prompts, data):
    index = SharedPrompts()
    requests = [request(str(i), p) for i, p in enumerate(prompts)]
    for r in requests:
        index.add(r)
    removed = data.draw(st.sets(st.sampled_from([r.request_id for r in requests])))
    for rid in removed:
        before = index.version
        index.remove(rid)
        assert index.version != before  # the scheduler's cached matches go stale
        index.remove(rid)
        assert index.version == before + 1  # nothing left to remove: nothing changed
    for r in requests:
        # Oracle: over the other prompts still indexed, the longest common prefix in whole
        # blocks of both prompts, short of r's last token; the prompts that share it.
        shared = {}
        for o in requests:
            if o is r or o.request_id in removed:
                continue
            a, b = r.token_ids, o.token_ids
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            shared[o.request_id] = min(n, len(b), len(a) - 1) // BLOCK * BLOCK
        best = max(shared.values(), default=0)
        assert index.longest_match(r) == best
        if best:
            assert sorted(index.holders(r, best)) == sorted(
                rid for rid, n in shared.items() if n == best)


@settings(max_examples=60, deadline=None)
@given(prompt_sets(), st.integers(4, 24), st.integers(12, 40), st.data())
def test_random_arrivals_under_preemption_all_finish_with_consistent_books(
        prompts, budget, num_pages, data):
    """Requests sharing random prefixes arrive at random steps on a full + Mamba toy small
    enough to preempt: every request finishes, the pool's books hold after every step,
    and a request's first hit never exceeds what some other prompt shares with it."""
    s = make(full(), mamba(), budget=budget, num_pages=num_pages)
    arrivals = sorted((data.draw(st.integers(0, 6)), i) for i in range(len(prompts)))
    reqs = {str(i): Request(str(i), p, SamplingParams(max_tokens=3), hash_block_size=BLOCK)
            for i, p in enumerate(prompts)}
    admitted_hit: dict[str, int] = {}
    for step_no in range(400):
        for at, i in arrivals:
            if at == step_no:
                s.add_request(reqs[str(i)])
        if step_no > 6 and not s.has_unfinished:
            break
        out = s.schedule()
        for new in out.new_requests:
            admitted_hit.setdefault(new.request_id, new.num_computed_tokens)
        done = [r for r in s.update_from_output(out, {rid: 7 for rid in
                                                      out.num_scheduled_tokens})
                if len(r.output_token_ids) >= r.sampling_params.max_tokens]
        s.finish(done, RequestStatus.FINISHED_LENGTH)
        for r in s.take_never_fitting():
            s.finish([r], RequestStatus.FINISHED_ABORTED, computed=False)
        s.kv.check_integrity()
    assert not s.has_unfinished
    for rid, hit in admitted_hit.items():
        mine = reqs[rid].token_ids[:reqs[rid].num_prompt_tokens]
        best = 0
        for other in prompts:
            n = 0
            while n < min(len(mine), len(other)) and mine[n] == other[n]:
                n += 1
            if other is not prompts[int(rid)]:
                best = max(best, n)
        assert hit <= best
