"""The official `anthropic` client against /v1/messages: greedy replies equal `LLM.generate`
on the same chat, streamed with Anthropic's events; tools, stop reasons, usage with
cache-read tokens, count_tokens, and errors in Anthropic's envelope."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.apis import (
    LONG_CONTEXT,
    TIME_PARAMETERS,
    WEATHER_PARAMETERS,
    chat_prompt,
    validates,
)
from tests.server.conftest import LiveServer, greedy, live_server

anthropic = pytest.importorskip("anthropic")

GREEDY = {"temperature": 0}  # the client has no temperature argument: sent as extra_body
TOOLS = [{"name": "get_weather", "description": "the weather in a city",
          "input_schema": WEATHER_PARAMETERS},
         {"name": "get_time", "description": "the time in a zone",
          "input_schema": TIME_PARAMETERS}]


@pytest.fixture(scope="module")
def server(demo_dir: Path) -> Iterator[LiveServer]:
    with live_server(demo_dir, engine=LONG_CONTEXT) as live:
        yield live


def client(server: LiveServer, api_key: str = "unused") -> Any:
    return anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0)


def sse_events(server: LiveServer, body: dict[str, Any]) -> list[tuple[str, Any]]:
    """(event name, data) of a streamed /v1/messages, as sent."""
    import json

    events = []
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, timeout=30) as r:
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
    return events


def test_text_equals_offline_greedy_whole_and_streamed(server: LiveServer,
                                                       offline: Any) -> None:
    messages = [{"role": "user", "content": "count to five"}]
    prompt = chat_prompt(server, [{"role": "system", "content": "be brief"}, *messages])
    [expected] = greedy(offline, [prompt], 9)
    c = client(server)
    reply = c.messages.create(model="test-model", max_tokens=9, system="be brief",
                              messages=messages, extra_body=GREEDY)
    assert [block.type for block in reply.content] == ["text"]
    assert reply.content[0].text == expected.text
    assert reply.stop_reason == "max_tokens" and reply.role == "assistant"
    assert reply.usage.output_tokens == 9
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(prompt)
    # System as text blocks, streamed: the same text, in Anthropic's event sequence.
    with c.messages.stream(model="test-model", max_tokens=9, messages=messages,
                           system=[{"type": "text", "text": "be brief"}],
                           extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == expected.text and final.stop_reason == "max_tokens"
    # On the wire (the client drops pings): Anthropic's event sequence.
    events = sse_events(server, {"model": "test-model", "max_tokens": 9, "stream": True,
                                 "messages": messages, "system": "be brief", **GREEDY})
    kinds = [name for name, _ in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    assert "".join(data["delta"]["text"] for name, data in events
                   if name == "content_block_delta") == expected.text
    # The same prompt again: its blocks come from the prefix cache.
    assert final.usage.cache_read_input_tokens > 0


def test_stop_sequence_and_end_turn(server: LiveServer, offline: Any) -> None:
    messages = [{"role": "user", "content": "say something long"}]
    [free] = greedy(offline, [chat_prompt(server, messages)], 12)
    cut = free.text[len(free.text) // 2:][:2]
    c = client(server)
    reply = c.messages.create(model="test-model", max_tokens=12, messages=messages,
                              stop_sequences=[cut], extra_body=GREEDY)
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == cut
    assert reply.content[0].text == free.text[:free.text.index(cut)]


def test_stop_reasons_of_each_ending() -> None:
    from hybridkv.engine.outputs import RequestOutput
    from hybridkv.server.anthropic_api import MessagesRequest, stop_reason

    body = MessagesRequest(model="m", max_tokens=4, stop_sequences=["END"],
                           messages=[{"role": "user", "content": "x"}])  # type: ignore[list-item]

    def ended(reason: str, by: int | str | None) -> RequestOutput:
        return RequestOutput("r", [1], [2], "t", True, finish_reason=reason, stop_reason=by)

    assert stop_reason(body, ended("stop", 1), False) == ("end_turn", None)  # EOS
    assert stop_reason(body, ended("stop", "END"), False) == ("stop_sequence", "END")
    assert stop_reason(body, ended("length", None), False) == ("max_tokens", None)
    assert stop_reason(body, ended("stop", 1), True) == ("tool_use", None)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}])
def test_a_forced_tool_gives_input_that_fits_the_schema(server: LiveServer, choice: Any,
                                                        stream: bool) -> None:
    c = client(server)
    body = dict(model="test-model", max_tokens=200, tools=TOOLS, tool_choice=choice,
                messages=[{"role": "user", "content": "what is the weather?"}],
                extra_body=GREEDY)
    if stream:
        with c.messages.stream(**body) as events:
            reply = events.get_final_message()
    else:
        reply = c.messages.create(**body)
    assert reply.stop_reason == "tool_use"
    [call] = [block for block in reply.content if block.type == "tool_use"]
    assert call.id.startswith("toolu_")
    schemas = {tool["name"]: tool["input_schema"] for tool in TOOLS}
    assert validates(call.input, schemas[call.name])
    if choice["type"] == "tool":
        assert call.name == "get_time"


def test_tool_results_continue_the_conversation(server: LiveServer, offline: Any) -> None:
    """tool_use and tool_result blocks render as the OpenAI form of the same turns."""
    arguments = {"city": "Paris", "unit": "celsius"}
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": arguments}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21"},
            {"type": "text", "text": "and so?"}]}]
    openai_form = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [{
            "id": "toolu_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21"},
        {"role": "user", "content": "and so?"}]
    prompt = chat_prompt(server, openai_form)
    [expected] = greedy(offline, [prompt], 6)
    c = client(server)
    reply = c.messages.create(model="test-model", max_tokens=6, messages=messages,
                              tool_choice={"type": "none"}, tools=TOOLS[:1],
                              extra_body=GREEDY)
    assert reply.content[0].text == expected.text
    counted = c.messages.count_tokens(model="test-model", messages=messages)
    assert counted.input_tokens == len(prompt)


def test_count_tokens_counts_the_rendered_prompt(server: LiveServer) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    counted = client(server).messages.count_tokens(model="test-model", system="be brief",
                                                   messages=messages)
    assert counted.input_tokens == len(chat_prompt(
        server, [{"role": "system", "content": "be brief"}, *messages]))


@pytest.mark.parametrize(("body", "status", "kind", "words"), [
    ({"model": "claude-x"}, 404, "not_found_error", "claude-x"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     400, "invalid_request_error", "'image' are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     400, "invalid_request_error", "'document' are not supported"),
    ({"tools": [{"name": "t", "input_schema": {"type": "object", "properties": {
        "a": {"type": "strin"}}}}]}, 400, "invalid_request_error", "tools[0]"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS},
     400, "invalid_request_error", "nope"),
    ({"max_tokens": "many"}, 400, "invalid_request_error", "max_tokens"),
    ({"temperature": -1}, 400, "invalid_request_error", "temperature"),
    ({"unknown": 1}, 400, "invalid_request_error", "unknown field 'unknown'"),
])
def test_bad_input_gets_anthropics_envelope(server: LiveServer, body: dict[str, Any],
                                            status: int, kind: str, words: str) -> None:
    request = {"model": "test-model", "max_tokens": 4,
               "messages": [{"role": "user", "content": "hi"}], **body}
    response = httpx.post(f"{server.url}/v1/messages", json=request, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert words in error["error"]["message"] and "\n" not in error["error"]["message"]
    if isinstance(request["max_tokens"], int):  # the client's own check comes first
        arguments = ("model", "max_tokens", "messages", "tools", "tool_choice")
        with pytest.raises(anthropic.APIStatusError) as raised:
            client(server).messages.create(
                **{k: v for k, v in request.items() if k in arguments},
                extra_body={k: v for k, v in request.items() if k not in arguments})
        assert raised.value.status_code == status
        assert raised.value.body["error"]["type"] == kind


def test_the_api_key_is_read_from_x_api_key(demo_dir: Any) -> None:
    with live_server(demo_dir, api_key="sekret") as live:
        with pytest.raises(anthropic.AuthenticationError):
            client(live, "wrong").messages.create(
                model="test-model", max_tokens=2, messages=[{"role": "user", "content": "x"}])
        # Greedy: Anthropic's default temperature of 1 may sample the end of the reply.
        reply = client(live, "sekret").messages.create(
            model="test-model", max_tokens=2, extra_body={"temperature": 0},
            messages=[{"role": "user", "content": "x"}])
        assert reply.usage.output_tokens == 2
