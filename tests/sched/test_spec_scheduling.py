"""The scheduler with drafts, against a real KVCacheManager and a fake model (no torch):
drafts as extra scheduled tokens, computed tokens after acceptance (replayed on state
groups), the back-off after misses, the draft length following acceptance, and the cap
on drafting requests with state groups."""

from __future__ import annotations

from hybridkv.kv.manager import KVCacheManager
from hybridkv.kv.spec import with_speculative_states
from hybridkv.sched.request import Request, RequestStatus
from hybridkv.sched.sampling import SamplingParams
from hybridkv.sched.scheduler import (
    DRAFT_BACKOFF_MAX,
    DRAFT_TOKENS_PER_STEP,
    Scheduler,
    SchedulerConfig,
    draft_limit,
    drafts_per_request,
)
from hybridkv.sched.spec import SpeculativeConfig
from hybridkv.sched.spec.config import MAX_SPECULATIVE_TOKENS
from tests.kv.toy import full, mamba, toy_config

SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
LOOP = [1, 2, 3, 4] * 3  # prompt lookup drafts [1, 2, 3] after it


def make(*specs, max_seqs=8):
    # As the engine builds it: state layers hold a state more in drafting steps.
    specs = tuple(with_speculative_states({str(i): spec for i, spec in enumerate(specs)},
                                          max_num_seqs=max_seqs).values())
    kv = KVCacheManager(toy_config(*specs, num_pages=64), max_model_len=64)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=max_seqs,
                                     max_model_len=64, speculative=SPEC), kv)


def request(rid, prompt=LOOP, max_tokens=20, draft_limit=None):
    """`draft_limit`: the request's as after steps that kept all their drafts (it starts
    at one: test_a_request_starts_at_one_draft_and_doubles_while_all_are_kept)."""
    req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), hash_block_size=4)
    if draft_limit is not None:
        req.draft_limit = draft_limit
    return req


def test_drafts_are_scheduled_tokens_and_acceptance_sets_computed_tokens():
    s = make(full())
    s.add_request(request("a", draft_limit=3))
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {}  # the prompt step drafts nothing
    s.update_from_output(out, {"a": 1})
    out = s.schedule()
    # Known tokens [.. 3 4 1]: the suffix "3 4 1" is followed by "2 3 4".
    assert out.scheduled_spec_decode_tokens == {"a": [2, 3, 4]}
    assert out.num_scheduled_tokens == {"a": 4}
    req = s.requests["a"]
    assert req.num_tokens == 13  # drafts are not the request's tokens
    [done] = s.update_from_output(out, {"a": 9}, {"a": [2, 3]})
    assert done.output_token_ids == [1, 2, 3, 9] and done.num_new_tokens == 3
    # One draft rejected: its slot is written again by the token 9 in the next step.
    assert req.num_computed_tokens == 12 + 1 + 2
    assert (req.num_draft_tokens, req.num_accepted_tokens, req.num_drafts) == (3, 2, 1)
    s.kv.check_integrity()


def test_state_groups_replay_accepted_drafts_after_a_rejection():
    s = make(full(), mamba())
    s.add_request(request("a", draft_limit=3))
    s.update_from_output(s.schedule(), {"a": 1})
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [2, 3, 4]}
    # The state at the known tokens (13) is saved in a private block for the step.
    assert [(g, p) for g, p, _ in out.state_checkpoints["a"]] == [(1, 13)]
    s.update_from_output(out, {"a": 9}, {"a": [2]})
    req = s.requests["a"]
    # The state stands at the known tokens: the accepted draft is computed again.
    assert req.num_computed_tokens == 13 and req.num_tokens == 15
    out = s.schedule()
    assert out.num_scheduled_tokens["a"] == 2 + len(out.scheduled_spec_decode_tokens.get("a", []))
    s.update_from_output(out, {"a": 5}, {"a": out.scheduled_spec_decode_tokens.get("a", [])})
    s.kv.check_integrity()
    s.finish([req], RequestStatus.FINISHED_STOPPED)
    s.kv.check_integrity()


def test_all_drafts_accepted_on_state_groups_needs_no_replay():
    s = make(full(), mamba())
    s.add_request(request("a", draft_limit=3))
    s.update_from_output(s.schedule(), {"a": 1})
    out = s.schedule()
    s.update_from_output(out, {"a": 1}, {"a": [2, 3, 4]})
    assert s.requests["a"].num_computed_tokens == 16


def test_misses_pause_drafting_longer_each_time_and_a_hit_resets():
    s = make(full())
    s.add_request(request("a", max_tokens=60))
    s.update_from_output(s.schedule(), {"a": 1})
    req = s.requests["a"]
    pauses = []
    for _ in range(40):
        out = s.schedule()
        drafts = out.scheduled_spec_decode_tokens.get("a")
        pauses.append(bool(drafts))
        s.update_from_output(out, {"a": 1}, {"a": []} if drafts else None)
    # Drafted, then 1, 2, 4, 8, 16, 16 steps without: the pauses double up to the cap.
    gaps, run = [], 0
    for drafted in pauses:
        if drafted:
            gaps.append(run)
            run = 0
        else:
            run += 1
    assert gaps[:6] == [0, 1, 2, 4, 8, DRAFT_BACKOFF_MAX]
    req.draft_pause = 0
    out = s.schedule()
    drafts = out.scheduled_spec_decode_tokens["a"]
    s.update_from_output(out, {"a": 1}, {"a": drafts[:1]})
    assert req.draft_backoff == req.draft_pause == 0


def test_a_request_starts_at_one_draft_and_doubles_while_all_are_kept():
    s = make(full())  # K = 3
    s.add_request(request("a", prompt=[1, 2, 3, 4] * 6, max_tokens=40))
    s.update_from_output(s.schedule(), {"a": 1})
    lengths = []
    for _ in range(3):
        out = s.schedule()
        drafts = out.scheduled_spec_decode_tokens["a"]
        lengths.append(len(drafts))
        s.update_from_output(out, {"a": drafts[-1] % 4 + 1}, {"a": drafts})
    assert lengths == [1, 2, 3]  # 1, 2, then 4 capped at K
    s.kv.check_integrity()


def test_the_draft_length_follows_what_was_kept():
    # One past the drafts kept after a rejection; twice the limit after a step that kept
    # all (at most num_speculative_tokens' bound).
    assert [draft_limit(8, 8, kept) for kept in (0, 3, 7, 8)] == [1, 4, 8, 16]
    assert draft_limit(4, 2, 2) == 8  # fewer drafts than the limit, all kept
    assert draft_limit(MAX_SPECULATIVE_TOKENS, 4, 4) == MAX_SPECULATIVE_TOKENS
    s = make(full())
    s.add_request(request("a", max_tokens=40, draft_limit=3))
    s.update_from_output(s.schedule(), {"a": 1})
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens["a"] == [2, 3, 4]
    s.update_from_output(out, {"a": 3}, {"a": [2]})  # ... 1 2 3: the loop goes on
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens["a"] == [4, 1]  # 1 kept: 2 next
    s.update_from_output(out, {"a": 2}, {"a": [4, 1]})
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens["a"] == [3, 4, 1]  # all kept: 4, K = 3
    s.kv.check_integrity()


def test_with_state_groups_at_most_a_share_of_requests_draft_per_step():
    s = make(full(), mamba())
    assert s.kv.max_drafting_requests == 2  # 30% of 8
    for rid in "abcde":
        s.add_request(request(rid))
    s.update_from_output(s.schedule(), dict.fromkeys("abcde", 1))
    out = s.schedule()
    assert len(out.scheduled_spec_decode_tokens) == 2
    assert len(out.num_scheduled_tokens) == 5
    s.kv.check_integrity()


def test_at_large_batches_each_request_drafts_less():
    # DRAFT_TOKENS_PER_STEP = 32 shared out: K while K x running fits, then fewer, never 0.
    assert [drafts_per_request(4, n) for n in (1, 8, 9, 16, 17, 32, 64, 500)] == \
        [4, 4, 3, 2, 1, 1, 1, 1]
    assert drafts_per_request(0, 1) == 0
    assert DRAFT_TOKENS_PER_STEP == 32
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    kv = KVCacheManager(toy_config(full(), num_pages=256), max_model_len=64)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=32,
                                  max_model_len=64, speculative=spec), kv)
    for i in range(12):
        s.add_request(request(f"r{i}", draft_limit=4))
    s.update_from_output(s.schedule(), {f"r{i}": 1 for i in range(12)})
    out = s.schedule()
    # 12 running: 32 // 12 = 2 drafts each (prompt lookup would give 4).
    assert {len(d) for d in out.scheduled_spec_decode_tokens.values()} == {2}
    assert len(out.scheduled_spec_decode_tokens) == 12
    s.update_from_output(out, {f"r{i}": 1 for i in range(12)},
                         {rid: d for rid, d in out.scheduled_spec_decode_tokens.items()})
    for rid in ("r0", "r1", "r2", "r3", "r4", "r5", "r6", "r7"):
        s.finish([s.requests[rid]], RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    # 4 left running: each gets its full K again.
    assert {len(d) for d in out.scheduled_spec_decode_tokens.values()} == {4}
    s.kv.check_integrity()


def test_a_worker_method_reserves_draft_slots_and_takes_the_worker_drafts():
    spec = SpeculativeConfig(method="draft_model", model="small", num_speculative_tokens=3)
    kv = KVCacheManager(toy_config(full(), mamba(), num_pages=64), max_model_len=64)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8,
                                  max_model_len=64, speculative=spec), kv)
    # nothing to look up: slots regardless
    s.add_request(request("a", prompt=[5, 6, 7], draft_limit=3))
    out = s.schedule()
    assert out.num_draft_slots == {}  # the prompt step drafts nothing
    s.update_from_output(out, {"a": 1})
    out = s.schedule()
    assert out.num_draft_slots == {"a": 3} and out.scheduled_spec_decode_tokens == {}
    assert out.num_scheduled_tokens == {"a": 4}
    [req] = s.update_from_output(out, {"a": 9}, {"a": [2, 3]}, {"a": [2, 3, 4]})
    assert req.output_token_ids == [1, 2, 3, 9]
    assert (req.num_draft_tokens, req.num_accepted_tokens) == (3, 2)
    # A state group cannot rewind: the accepted drafts are computed again next step.
    assert req.num_computed_tokens == 4
    s.kv.check_integrity()
