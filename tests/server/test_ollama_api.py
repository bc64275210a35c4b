"""The official `ollama` client against /api: the model's listing and details, chat and
generate equal `LLM.generate`, streamed as NDJSON by default, options, format, tools,
timings, and what is not served."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.apis import LONG_CONTEXT, WEATHER_PARAMETERS, chat_prompt, validates
from tests.server.conftest import LiveServer, greedy, live_server

ollama = pytest.importorskip("ollama")

GREEDY = {"temperature": 0}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description":
                                            "the weather in a city",
                                            "parameters": WEATHER_PARAMETERS}}


@pytest.fixture(scope="module")
def server(demo_dir: Path) -> Iterator[LiveServer]:
    with live_server(demo_dir, engine=LONG_CONTEXT) as live:
        yield live


def client(server: LiveServer) -> Any:
    return ollama.Client(host=server.url)


def test_the_served_model_is_listed_shown_and_running(server: LiveServer) -> None:
    c = client(server)
    [listed] = c.list().models
    assert listed.model == "test-model:latest" and listed.size > 0
    assert listed.details.family == "llama" and listed.details.format == "safetensors"
    [running] = c.ps().models
    assert running.model == "test-model:latest" and running.context_length == 2048
    shown = c.show("test-model")
    assert "capabilities" in shown and "completion" in shown.capabilities
    assert shown.template and "message" in shown.template
    assert shown.modelinfo["llama.context_length"] == 2048
    version = httpx.get(f"{server.url}/api/version", timeout=10).json()
    import hybridkv

    assert version == {"version": hybridkv.__version__}


def test_chat_equals_offline_greedy_whole_and_streamed(server: LiveServer,
                                                       offline: Any) -> None:
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "count to five"}]
    prompt = chat_prompt(server, messages)
    [expected] = greedy(offline, [prompt], 9)
    c = client(server)
    reply = c.chat(model="test-model", messages=messages,
                   options={**GREEDY, "num_predict": 9})
    assert reply.message.role == "assistant" and reply.message.content == expected.text
    assert reply.done and reply.done_reason == "length"
    assert reply.eval_count == 9 and reply.eval_duration > 0
    assert 0 < reply.prompt_eval_count <= len(prompt)
    assert reply.total_duration >= reply.prompt_eval_duration + reply.eval_duration > 0
    parts = list(c.chat(model="test-model:latest", messages=messages, stream=True,
                        options={**GREEDY, "num_predict": 9}))
    assert "".join(p.message.content for p in parts) == expected.text
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].eval_count == 9 and parts[-1].done_reason == "length"
    # Raw: NDJSON by default, one JSON object a line.
    with httpx.stream("POST", f"{server.url}/api/chat", timeout=30, json={
            "model": "test-model", "messages": messages,
            "options": {**GREEDY, "num_predict": 9}}) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert "".join(line["message"]["content"] for line in lines) == expected.text


def test_generate_templates_the_prompt_unless_raw(server: LiveServer, offline: Any) -> None:
    c = client(server)
    prompt = chat_prompt(server, [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "hello"}])
    [expected] = greedy(offline, [prompt], 8)
    reply = c.generate(model="test-model", prompt="hello", system="be brief",
                       options={**GREEDY, "num_predict": 8})
    assert reply.response == expected.text and reply.done_reason == "length"
    assert list(reply.context) == prompt + expected.token_ids
    text = "the quick brown fox jumps over the lazy dog " * 3
    [raw] = greedy(offline, [text], 6)
    parts = list(c.generate(model="test-model", prompt=text, raw=True,
                            stream=True, options={**GREEDY, "num_predict": 6}))
    assert "".join(p.response for p in parts) == raw.text
    # `context` continues the exchange: its tokens, then the new prompt's.
    again = c.generate(model="test-model", prompt=" and then", raw=True,
                       context=parts[-1].context, options={**GREEDY, "num_predict": 4})
    ids = list(parts[-1].context) + offline.engine.tokenizer.encode(
        " and then", add_special_tokens=False).ids
    [continued] = greedy(offline, [ids], 4)
    assert again.response == continued.text
    assert again.prompt_eval_count < len(ids)  # the earlier exchange came from the cache


def test_options_are_honoured(server: LiveServer, offline: Any) -> None:
    from hybridkv import SamplingParams

    messages = [{"role": "user", "content": "say something"}]
    prompt = chat_prompt(server, messages)
    [expected] = offline.generate([prompt], SamplingParams(
        max_tokens=10, temperature=0.9, top_k=20, top_p=0.8, min_p=0.05, seed=7,
        repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2))
    reply = client(server).chat(model="test-model", messages=messages, options={
        "num_predict": 10, "temperature": 0.9, "top_k": 20, "top_p": 0.8, "min_p": 0.05,
        "seed": 7, "repeat_penalty": 1.3, "presence_penalty": 0.5,
        "frequency_penalty": 0.2, "num_ctx": 1024, "num_gpu": 1, "num_thread": 2},
        keep_alive="5m")
    assert reply.message.content == expected.text
    [free] = greedy(offline, [prompt], 12)
    cut = free.text[len(free.text) // 2:][:2]
    stopped = client(server).chat(model="test-model", messages=messages,
                                  options={**GREEDY, "num_predict": 12, "stop": [cut]})
    assert stopped.message.content == free.text[:free.text.index(cut)]
    assert stopped.done_reason == "stop"


def test_format_json_and_schema(server: LiveServer) -> None:
    c = client(server)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    reply = c.chat(model="test-model", messages=[{"role": "user", "content": "a number"}],
                   format=schema, options={**GREEDY, "num_predict": 200})
    assert validates(json.loads(reply.message.content), schema)
    loose = c.generate(model="test-model", prompt="json please", format="json",
                       options={**GREEDY, "num_predict": 400})
    assert loose.done_reason == "stop" and isinstance(json.loads(loose.response), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_fits_the_schema(server: LiveServer, stream: bool) -> None:
    """Ollama has no tool_choice: a JSON-forcing format makes the greedy demo model call."""
    c = client(server)
    call_schema = {"type": "object", "properties": {
        "name": {"const": "get_weather"}, "arguments": WEATHER_PARAMETERS},
        "required": ["name", "arguments"], "additionalProperties": False}
    body = dict(model="test-model", messages=[{"role": "user", "content": "weather?"}],
                tools=[WEATHER], format=call_schema, options={**GREEDY, "num_predict": 200})
    if stream:
        calls = [call for part in c.chat(**body, stream=True)
                 for call in part.message.tool_calls or []]
    else:
        calls = list(c.chat(**body).message.tool_calls or [])
    [call] = calls
    assert call.function.name == "get_weather"
    assert validates(dict(call.function.arguments), WEATHER_PARAMETERS)


def test_earlier_tool_calls_and_results_render(server: LiveServer, offline: Any) -> None:
    arguments = {"city": "Rome", "unit": "celsius"}
    messages = [{"role": "user", "content": "weather in Rome?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    prompt = chat_prompt(server, [
        {"role": "user", "content": "weather in Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": arguments}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "get_weather",
         "name": "get_weather"}])
    [expected] = greedy(offline, [prompt], 5)
    reply = client(server).chat(model="test-model", messages=messages,
                                options={**GREEDY, "num_predict": 5})
    assert reply.message.content == expected.text


@pytest.mark.parametrize(("path", "method", "body", "status", "words"), [
    ("/api/pull", "POST", {"model": "llama3"}, 501, "one model"),
    ("/api/embed", "POST", {"model": "test-model", "input": "x"}, 501, "embeddings"),
    ("/api/embeddings", "POST", {"model": "test-model", "prompt": "x"}, 501, "embeddings"),
    ("/api/delete", "DELETE", {"model": "test-model"}, 501, "one model"),
    ("/api/chat", "POST", {"model": "llama3", "messages": []}, 404, "llama3"),
    ("/api/chat", "POST", {"model": "test-model", "messages": [
        {"role": "user", "content": "x", "images": ["AAAA"]}]}, 400, "images"),
    ("/api/chat", "POST", {"model": "test-model", "messages": [
        {"role": "user", "content": "x"}], "options": {"mirostat": 2}}, 400, "mirostat"),
    ("/api/chat", "POST", {"model": "test-model", "messages": [
        {"role": "user", "content": "x"}], "options": {"num_ctx": 10**6}}, 400, "num_ctx"),
    ("/api/chat", "POST", {"model": "test-model", "messages": [
        {"role": "user", "content": "x"}], "format": "yaml"}, 400, "format"),
    ("/api/chat", "POST", {"model": "test-model", "messages": [
        {"role": "user", "content": "x"}], "think": True}, 400, "does not think"),
    ("/api/generate", "POST", {"model": "test-model", "prompt": "x",
                               "options": {"bogus": 1}}, 400, "bogus"),
    ("/api/nothing", "GET", None, 404, "/api/nothing"),
])
def test_errors_are_ollamas_one_line(server: LiveServer, path: str, method: str,
                                     body: Any, status: int, words: str) -> None:
    response = httpx.request(method, f"{server.url}{path}", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()
    assert list(error) == ["error"] and words in error["error"]
    assert "\n" not in error["error"]
    if path == "/api/pull":
        with pytest.raises(ollama.ResponseError) as raised:
            client(server).pull("llama3")
        assert raised.value.status_code == 501


def test_an_empty_chat_loads_the_model(server: LiveServer) -> None:
    reply = client(server).chat(model="test-model", messages=[])
    assert reply.done and reply.done_reason == "load"
