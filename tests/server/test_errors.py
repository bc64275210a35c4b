"""Bad requests over raw HTTP: each answered with its status and OpenAI's error envelope,
never a 500, and the server keeps serving good requests after each."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from tests.server.conftest import LiveServer, live_server

C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

# (path, body (a dict, or raw bytes), status, the param named)
BAD: list[tuple[str, Any, int, str | None]] = [
    (C, b"{not json", 400, None),
    (C, b"", 400, None),
    (C, b"[1, 2]", 400, None),
    (C, {}, 400, "prompt"),
    (C, {"prompt": "x", "bogus": 1}, 400, "bogus"),
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {"prompt": [1.5, 2]}, 400, "prompt"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": [1, 2, 10**6]}, 400, "prompt"),
    (C, {"prompt": [-1]}, 400, "prompt"),
    (C, {"prompt": "x " * 600}, 400, "prompt"),
    (C, {"prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    (C, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    (C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "x", "top_p": 1e300}, 400, "top_p"),
    (C, {"prompt": "x", "top_k": -2}, 400, "top_k"),
    (C, {"prompt": "x", "seed": 2**70}, 400, "seed"),
    (C, {"prompt": "x", "stop": [""]}, 400, "stop"),
    (C, {"prompt": "x", "stop": 3}, 400, "stop"),
    (C, {"prompt": "x", "stop_token_ids": [-3]}, 400, "stop_token_ids"),
    (C, {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    (C, {"prompt": "x", "n": 0}, 400, "n"),
    (C, {"prompt": "x", "n": 10**4}, 400, "n"),
    (C, {"prompt": "x", "echo": True, "logprobs": 2}, 400, "echo"),
    (C, {"prompt": "x", "best_of": 3}, 400, "best_of"),
    (C, {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    (C, {"prompt": "x", "frequency_penalty": -7}, 400, "frequency_penalty"),
    (C, {"prompt": "x", "repetition_penalty": 0.0}, 400, "repetition_penalty"),
    (C, {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    (C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    (C, {"prompt": "x", "stream_options": {"include_usage": "yes"}}, 400, "stream_options"),
    (C, {"prompt": "x", "model": "other-model"}, 404, "model"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "extra": 1}]}, 400, "messages"),
    (CHAT, {"messages": "hello"}, 400, "messages"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools"),
    (CHAT, {"messages": USER, "model": "nope"}, 404, "model"),
    ("/tokenize", {}, 400, "prompt"),
    ("/detokenize", {"tokens": [10**7]}, 400, "tokens"),
    ("/v1/nothing-here", {}, 404, None),
]


def check_envelope(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    assert error["code"] == status and error["param"] == param, error


def test_bad_requests_get_the_envelope_and_the_server_goes_on(server: LiveServer) -> None:
    assert len(BAD) >= 25
    with server.client() as http:
        for path, body, status, param in BAD:
            if isinstance(body, bytes):
                response = http.post(path, content=body,
                                     headers={"content-type": "application/json"})
            else:
                response = http.post(path, json=body)
            check_envelope(response, status, param)
            # Sampled (temperature 1 by default): EOS may come first, so it is ignored.
            good = http.post(C, json={"prompt": "the quick", "max_tokens": 2,
                                      "ignore_eos": True})
            assert good.status_code == 200, (path, body, good.text)
            assert good.json()["usage"]["completion_tokens"] == 2


def test_missing_chat_template_is_a_400_that_says_so(tmp_path: Any) -> None:
    from tests.models.tiny import build_tiny_model

    model = build_tiny_model("llama", tmp_path / "tiny")
    with live_server(model) as live, live.client() as http:
        response = http.post(CHAT, json={"messages": USER})
        check_envelope(response, 400, "messages")
        assert "chat template" in response.json()["error"]["message"]
        # Token ids still work on a model without a tokenizer.
        ok = http.post(C, json={"prompt": [3, 4, 5], "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        check_envelope(http.post(C, json={"prompt": "text"}), 400, "prompt")


def test_a_full_queue_is_a_503_with_retry_after(demo_dir: Any) -> None:
    long = {"prompt": "the quick", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with live_server(demo_dir, max_waiting=1, engine={"max_num_seqs": 1}) as live, \
            live.client() as http:
        with http.stream("POST", C, json=long) as running:
            wait_for(live, "hybridkv:num_requests_running", 1)
            with http.stream("POST", C, json=long) as waiting:
                assert running.status_code == waiting.status_code == 200
                refused = http.post(C, json={"prompt": "x", "max_tokens": 2})
                check_envelope(refused, 503, None)
                assert refused.headers["retry-after"] == "1"
        # Both clients went away: their requests are aborted, and the queue opens again.
        wait_for(live, "hybridkv:num_requests_running", 0)
        wait_for(live, "hybridkv:num_requests_waiting", 0)
        assert http.post(C, json={"prompt": "x", "max_tokens": 2}).status_code == 200


def wait_for(live: LiveServer, metric: str, value: float, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while live.metrics()[metric] != value:
        assert time.monotonic() < deadline, f"{metric} stays {live.metrics()[metric]}"
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [False, True])
def test_engine_failure_makes_the_server_unhealthy(demo_dir: Any, stream: bool) -> None:
    with live_server(demo_dir) as live, live.client() as http:
        assert http.get("/health").status_code == 200
        engine = live.app.state.server.engine.engine

        def broken() -> None:
            raise RuntimeError("device lost")

        engine.step = broken
        response = http.post(C, json={"prompt": "x", "max_tokens": 4, "stream": stream})
        if stream:
            events = [line for line in response.text.splitlines() if line]
            assert "device lost" in json.loads(events[0].removeprefix("data: "))["error"][
                "message"]
            assert events[-1] == "data: [DONE]"
        else:
            check_envelope(response, 503, None)
        check_envelope(http.get("/health"), 503, None)
        check_envelope(http.post(C, json={"prompt": "x"}), 503, None)
