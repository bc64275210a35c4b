"""Speculative decoding's scheduler half: the config's one-line errors, the n-gram proposer,
and the greedy verification rule (no model)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.sched.spec import SpeculativeConfig, make_proposer
from hybridkv.sched.spec.ngram import NgramProposer


@pytest.mark.parametrize("values, message", [
    ({"method": "medusa2", "num_speculative_tokens": 2}, "'medusa2' is unknown; accepted: ngram"),
    ({"method": "draft_model", "num_speculative_tokens": 2},
     "method 'draft_model' needs a model: the draft model's path or name"),
    ({"method": "draft_model", "model": " "}, "method 'draft_model' needs a model"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 0},
     "num_speculative_tokens must be an integer in [1, 64], got 0"),
    ({"method": "ngram", "model": "x"}, "model applies to method 'draft_model', not 'ngram'"),
    ({"method": "mtp", "model": "x"}, "model applies to method 'draft_model', not 'mtp'"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "EAGLE heads are not supported"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an "
                                                       "integer in [1, 64], got 0"),
    ({"method": "ngram", "num_speculative_tokens": True}, "got True (bool)"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_min (3) must be <= prompt_lookup_max (2)"),
    ({"method": "ngram", "lookahead": 2}, "unknown speculative_config field(s) lookahead; "
                                          "accepted: method, num_speculative_tokens"),
    ({"num_speculative_tokens": 2}, "needs a method; accepted: ngram"),
    ("ngram", "speculative_config must be a dict"),
])
def test_bad_configs_fail_in_one_line(values, message):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.from_dict(values)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_draft_model_drafts_in_the_worker_and_has_no_scheduler_proposer():
    config = SpeculativeConfig.from_dict({"method": "draft_model", "model": "x"})
    assert config.drafts_in_worker and make_proposer(config) is None
    mtp = SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 2})
    assert mtp.drafts_in_worker and make_proposer(mtp) is None
    assert not SpeculativeConfig(method="ngram").drafts_in_worker


def test_ngram_takes_the_longest_suffix_at_its_latest_occurrence():
    p = NgramProposer(1, 3)
    # "1 2" occurred at 0 and at 4; the latest (4) is followed by 9.
    assert p.propose([1, 2, 3, 4, 1, 2, 9, 7, 1, 2], 2) == [9, 7]
    # The 3-gram "5 1 2" beats the 2-gram "1 2" (whose latest occurrence is followed by 8).
    assert p.propose([5, 1, 2, 6, 1, 2, 8, 5, 1, 2], 1) == [6]
    assert p.propose([1, 2, 3], 3) == []  # nothing repeats
    assert p.propose([4], 2) == []


def _brute_force(tokens: list[int], min_n: int, max_n: int, num: int) -> list[int]:
    """Every n-gram size from the longest, every earlier start from the latest."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[len(tokens) - n:]:
                seq = list(tokens)
                at = start + n
                out = []
                while len(out) < num:  # past the end the drafts continue themselves
                    seq.append(seq[at])
                    out.append(seq[at])
                    at += 1
                return out
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.integers(1, 4), st.integers(0, 3),
       st.integers(1, 6))
def test_ngram_matches_a_brute_force_search(tokens, min_n, extra, num):
    max_n = min_n + extra
    want = _brute_force(tokens, min_n, max_n, num) if len(tokens) > min_n else []
    assert NgramProposer(min_n, max_n).propose(tokens, num) == want


def test_ngram_continues_a_loop_past_the_end_of_the_tokens():
    p = NgramProposer(1, 4)
    assert p.propose([7, 8, 7, 8], 5) == [7, 8, 7, 8, 7]
    assert p.propose([3, 3, 3], 4) == [3, 3, 3, 3]


def test_ngram_respects_its_minimum():
    assert NgramProposer(2, 3).propose([1, 9, 1], 2) == []  # only a 1-gram repeats
    assert NgramProposer(1, 3).propose([1, 9, 1], 2) == [9, 1]


def test_registry_builds_the_configured_proposer():
    proposer = make_proposer(SpeculativeConfig(method="ngram", prompt_lookup_min=2,
                                               prompt_lookup_max=5))
    assert isinstance(proposer, NgramProposer)
    assert (proposer.min_n, proposer.max_n) == (2, 5)
