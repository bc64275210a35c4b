"""The official `openai` client against a live server: greedy outputs equal `LLM.generate`."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.conftest import LiveServer, greedy, live_server

openai = pytest.importorskip("openai")

PROMPTS = ["the quick brown fox", "Once upon a time, a small model", "hybrid models mix"]


def client(server: LiveServer, api_key: str = "none") -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0)


def test_models_lists_the_served_name(server: LiveServer) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["test-model"]


def test_completions_equal_offline_greedy(server: LiveServer, offline: Any) -> None:
    expected = greedy(offline, PROMPTS, 12)
    response = client(server).completions.create(model="test-model", prompt=PROMPTS,
                                                  max_tokens=12, temperature=0)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == [o.text for o in expected]
    assert [c.finish_reason for c in response.choices] == [o.finish_reason for o in expected]
    assert response.usage.completion_tokens == sum(len(o.token_ids) for o in expected)
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)


def test_token_id_prompts_and_streamed_completions(server: LiveServer, offline: Any) -> None:
    ids = [[5, 6, 7, 8, 9], [40, 41, 42]]
    expected = greedy(offline, ids, 10)
    texts = ["", ""]
    reasons: list[str | None] = [None, None]
    usage = None
    stream = client(server).completions.create(
        model="test-model", prompt=ids, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [o.text for o in expected]
    assert reasons == ["length", "length"]
    assert usage is not None and usage.completion_tokens == 20 and usage.prompt_tokens == 8


def chat_prompt(server: LiveServer, messages: list[dict[str, str]]) -> list[int]:
    response = httpx.post(f"{server.url}/tokenize", json={"messages": messages})
    assert response.status_code == 200, response.text
    return list(response.json()["tokens"])


def test_chat_equals_offline_greedy_whole_and_streamed(server: LiveServer,
                                                       offline: Any) -> None:
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "count to five"}]
    [expected] = greedy(offline, [chat_prompt(server, messages)], 9)
    c = client(server)
    response = c.chat.completions.create(model="test-model", messages=messages,  # type: ignore[arg-type]
                                         max_completion_tokens=9, temperature=0)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].finish_reason == "length"
    deltas = list(c.chat.completions.create(model="test-model", messages=messages,  # type: ignore[arg-type]
                                            max_completion_tokens=9, temperature=0,
                                            stream=True))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == expected.text
    assert deltas[-1].choices[0].finish_reason == "length"


def test_repeated_prefix_reports_cached_tokens(server: LiveServer) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    c = client(server)
    c.completions.create(model="test-model", prompt=prompt, max_tokens=2, temperature=0)
    again = c.completions.create(model="test-model", prompt=prompt + "again", max_tokens=2,
                                 temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_logprobs_are_returned(server: LiveServer) -> None:
    response = client(server).completions.create(model="test-model", prompt="the quick",
                                                  max_tokens=3, temperature=0, logprobs=2)
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == 3 and "".join(lp.tokens) == response.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)


def test_api_key_is_required_on_v1(demo_dir: Any) -> None:
    with live_server(demo_dir, api_key="sekret") as live:
        with pytest.raises(openai.AuthenticationError):
            client(live, "wrong").models.list()
        assert httpx.get(f"{live.url}/v1/models").status_code == 401
        assert httpx.get(f"{live.url}/health").status_code == 200
        out = client(live, "sekret").completions.create(model="test-model", prompt="hi",
                                                        max_tokens=2)
        assert out.usage.completion_tokens == 2


def test_stop_reason_names_the_stop_token_or_string(server: LiveServer, offline: Any) -> None:
    """`stop_reason` says what ended a "stop" completion, as vLLM's does: the stop token id
    or the stop string."""
    [free] = greedy(offline, [[5, 6, 7, 8, 9]], 8)
    stop_token = free.token_ids[3]
    body = {"model": "test-model", "prompt": [5, 6, 7, 8, 9], "max_tokens": 8,
            "temperature": 0}
    by_token = httpx.post(f"{server.url}/v1/completions", timeout=30,
                          json={**body, "stop_token_ids": [stop_token]}).json()["choices"][0]
    assert by_token["finish_reason"] == "stop"
    assert by_token["stop_reason"] == stop_token
    stop_text = free.text[len(free.text) // 2:][:2]
    assert stop_text, "the free-running text is too short to cut"
    by_text = httpx.post(f"{server.url}/v1/completions", timeout=30,
                         json={**body, "stop": [stop_text]}).json()["choices"][0]
    assert by_text["finish_reason"] == "stop" and by_text["stop_reason"] == stop_text
    length = httpx.post(f"{server.url}/v1/completions", timeout=30,
                        json=body).json()["choices"][0]
    assert length["finish_reason"] == "length" and length["stop_reason"] is None


def test_n_samples_equal_offline_samples(server: LiveServer, offline: Any) -> None:
    from hybridkv import SamplingParams

    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=3, ignore_eos=True)
    expected = offline.generate(PROMPTS[:2], sampled)
    c = client(server)
    response = c.completions.create(model="test-model", prompt=PROMPTS[:2], max_tokens=8,
                                    temperature=1.0, seed=3, n=3,
                                    extra_body={"ignore_eos": True})
    # Prompt-major: prompt i's samples are choices 3i .. 3i+2.
    assert [ch.index for ch in response.choices] == list(range(6))
    assert [ch.text for ch in response.choices] == [o.text for o in expected]
    assert len({ch.text for ch in response.choices[:3]}) > 1
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids)
                                               for o in expected[::3])
    assert response.usage.completion_tokens == 6 * 8
    # Streamed, the chunks of the three samples interleave; each adds up to its text.
    texts = [""] * 6
    for chunk in c.completions.create(model="test-model", prompt=PROMPTS[:2], max_tokens=8,
                                      temperature=1.0, seed=3, n=3, stream=True,
                                      extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [o.text for o in expected]
    messages = [{"role": "user", "content": "say something"}]
    chat = c.chat.completions.create(model="test-model", messages=messages,  # type: ignore[arg-type]
                                     max_completion_tokens=6, temperature=1.0, seed=9, n=2)
    [first, second] = offline.generate([chat_prompt(server, messages)], SamplingParams(
        max_tokens=6, temperature=1.0, seed=9, n=2))
    assert [ch.message.content for ch in chat.choices] == [first.text, second.text]
    deltas = ["", ""]
    roles = set()
    for chunk in c.chat.completions.create(model="test-model", messages=messages,  # type: ignore[arg-type]
                                           max_completion_tokens=6, temperature=1.0,
                                           seed=9, n=2, stream=True):
        for ch in chunk.choices:
            deltas[ch.index] += ch.delta.content or ""
            if ch.delta.role:
                roles.add(ch.index)
    assert deltas == [first.text, second.text] and roles == {0, 1}


def test_echo_penalties_min_p_and_logit_bias(server: LiveServer, offline: Any) -> None:
    from hybridkv import SamplingParams

    c = client(server)
    [plain] = greedy(offline, PROMPTS[:1], 6)
    echoed = c.completions.create(model="test-model", prompt=PROMPTS[0], max_tokens=6,
                                  temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + plain.text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="test-model", prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True,
        stream=True) if ch.choices)
    assert streamed == PROMPTS[0] + plain.text
    knobs = dict(presence_penalty=1.0, frequency_penalty=0.5)
    expected = offline.generate(PROMPTS[:1], SamplingParams(
        max_tokens=12, temperature=0.0, repetition_penalty=1.4, **knobs))[0]
    got = c.completions.create(model="test-model", prompt=PROMPTS[0], max_tokens=12,
                               temperature=0, extra_body={"repetition_penalty": 1.4}, **knobs)
    assert got.choices[0].text == expected.text
    sampled = offline.generate(PROMPTS[:1], SamplingParams(
        max_tokens=12, temperature=1.0, min_p=0.2, seed=4))[0]
    got = c.completions.create(model="test-model", prompt=PROMPTS[0], max_tokens=12,
                               temperature=1.0, seed=4, extra_body={"min_p": 0.2})
    assert got.choices[0].text == sampled.text
    forced = c.completions.create(model="test-model", prompt=PROMPTS[0], max_tokens=4,
                                  temperature=0, logit_bias={"65": 100},
                                  extra_body={"ignore_eos": True})
    assert offline.engine.tokenizer.encode(forced.choices[0].text).ids == [65] * 4
