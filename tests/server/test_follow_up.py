"""Holding a step for a client's next request: the adaptive policy, and a live server whose
client comes straight back while another request keeps the engine busy."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from hybridkv.server.follow_up import FollowUpWait
from tests.server.conftest import greedy, live_server


def test_holding_stops_while_it_does_not_pay_and_probes_again():
    wait = FollowUpWait(0.01, min_hit_rate=0.25, probe_every=4)
    assert wait.timeout() == 0.01  # holds from the start
    while wait.hit_rate >= 0.25:
        wait.record(False)
    # Below the share: every 4th end holds once more (a probe), the others do not.
    assert [wait.timeout() for _ in range(8)] == [None, None, None, 0.01] * 2
    for _ in range(3):
        wait.record(True)
    assert wait.hit_rate >= 0.25 and wait.timeout() == 0.01
    assert (wait.holds, wait.hits) == (wait.holds, 3)


def test_no_wait_never_holds_and_a_negative_one_is_refused():
    assert FollowUpWait(0).timeout() is None
    with pytest.raises(ValueError, match="follow-up wait must be >= 0"):
        FollowUpWait(-0.001)


def test_a_client_coming_straight_back_joins_the_next_step(demo_dir: Any, offline: Any):
    """While a long stream keeps the engine stepping, a short request ends; its client sends
    the next one at once and the server's hold meets it (a long hold here, so a slow machine
    still meets it); the answers stay the model's."""
    prompts = ["the quick brown fox", "the quick brown fox jumps over"]
    expected = [o.text for o in greedy(offline, prompts, 3)]
    with live_server(demo_dir, follow_up_wait_ms=3000) as live, live.client() as http:
        started = threading.Event()

        def long_stream() -> None:
            with live.client() as other, other.stream("POST", "/v1/completions", json={
                    "prompt": "a long answer", "max_tokens": 400, "ignore_eos": True,
                    "temperature": 0, "stream": True}) as response:
                for _ in response.iter_lines():
                    started.set()

        thread = threading.Thread(target=long_stream)
        thread.start()
        assert started.wait(30)
        got = []
        for prompt in prompts:  # the second sent the moment the first answer is back
            body = http.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 3, "temperature": 0}).json()
            got.append(body["choices"][0]["text"])
        metrics = live.metrics()
        thread.join(60)
    assert metrics["hybridkv:follow_up_holds_total"] >= 1
    assert metrics["hybridkv:follow_up_hits_total"] >= 1
    assert got == expected
