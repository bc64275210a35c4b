"""The official `openai` client against /v1/responses: replies equal `LLM.generate`, streamed
as the Responses API's events; function tools and their outputs, text.format schemas, and
store + previous_response_id recomputing only the new tokens."""

from __future__ import annotations

import json
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

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city",
          "parameters": WEATHER_PARAMETERS, "strict": True},
         {"type": "function", "name": "get_time", "description": "the time in a zone",
          "parameters": TIME_PARAMETERS, "strict": True}]
# ChatML, as most instruct models write it: a reply renders back as the model wrote it.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def server(demo_dir: Path) -> Iterator[LiveServer]:
    with live_server(demo_dir, engine=LONG_CONTEXT, max_stored_responses=4) as live:
        yield live


def client(server: LiveServer) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_text_equals_offline_greedy_whole_and_streamed(server: LiveServer,
                                                       offline: Any) -> None:
    prompt = chat_prompt(server, [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "count to five"}])
    [expected] = greedy(offline, [prompt], 9)
    c = client(server)
    response = c.responses.create(model="test-model", instructions="be brief",
                                  input="count to five", max_output_tokens=9, temperature=0)
    assert response.output_text == expected.text
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == len(prompt) and response.usage.output_tokens == 9
    # Items in, streamed out.
    events = list(c.responses.create(
        model="test-model", max_output_tokens=9, temperature=0, stream=True, input=[
            {"role": "system", "content": "be brief"},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "count to five"}]}]))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        expected.text
    assert events[-1].response.output[0].content[0].text == expected.text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}])
def test_a_forced_function_call_fits_the_schema(server: LiveServer, choice: Any,
                                                stream: bool) -> None:
    c = client(server)
    body = dict(model="test-model", input="what is the weather?", tools=TOOLS,
                tool_choice=choice, temperature=0, max_output_tokens=200)
    if stream:
        with c.responses.stream(**body) as events:
            kinds = [e.type for e in events]
            response = events.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
        assert kinds[-1] == "response.completed"
    else:
        response = c.responses.create(**body)
    [call] = [item for item in response.output if item.type == "function_call"]
    schemas = {tool["name"]: tool["parameters"] for tool in TOOLS}
    assert validates(json.loads(call.arguments), schemas[call.name])
    assert call.call_id.startswith("call_")
    if isinstance(choice, dict):
        assert call.name == "get_time"


def test_function_call_outputs_continue_the_conversation(server: LiveServer,
                                                         offline: Any) -> None:
    arguments = json.dumps({"city": "Paris", "unit": "celsius"})
    prompt = chat_prompt(server, [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    [expected] = greedy(offline, [prompt], 6)
    response = client(server).responses.create(
        model="test-model", temperature=0, max_output_tokens=6, tool_choice="none",
        tools=TOOLS, input=[
            {"role": "user", "content": "weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": arguments},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    assert response.output_text == expected.text


def test_text_format_json_schema(server: LiveServer) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    response = client(server).responses.create(
        model="test-model", input="a number", temperature=0, max_output_tokens=200,
        text={"format": {"type": "json_schema", "name": "number", "schema": schema}})
    assert response.status == "completed"
    assert validates(json.loads(response.output_text), schema)


def test_previous_response_id_recomputes_only_the_new_tokens(demo_dir: Path,
                                                             offline: Any) -> None:
    """Each turn renders the whole conversation again; the prompt is the earlier prompt's
    and reply's own tokens and the new ones, so all but the new tokens and the last partial
    block come from the prefix cache."""
    with live_server(demo_dir, chat_template=CHATML) as live:
        c = client(live)
        block = live.app.state.server.engine.engine.plan.config.hit_alignment
        previous = c.responses.create(model="test-model", input="tell me a story",
                                      max_output_tokens=30, temperature=0)
        for turn in ("and then?", "what happened next?"):
            response = c.responses.create(model="test-model", input=turn, temperature=0,
                                          previous_response_id=previous.id,
                                          max_output_tokens=30)
            usage = response.usage
            new = usage.input_tokens - previous.usage.total_tokens
            computed = usage.input_tokens - usage.input_tokens_details.cached_tokens
            assert new > 0 and computed <= new + block, (computed, new, block)
            previous = response
        # The stored conversation is the one a client would send whole.
        stored = c.responses.retrieve(previous.id)
        assert stored.id == previous.id and stored.output_text == previous.output_text


def test_the_store_keeps_the_last_responses(server: LiveServer) -> None:
    c = client(server)
    ids = [c.responses.create(model="test-model", input=f"hi {i}", max_output_tokens=1).id
           for i in range(5)]
    with pytest.raises(openai.NotFoundError, match="keeps the last 4"):
        c.responses.create(model="test-model", input="more", previous_response_id=ids[0],
                           max_output_tokens=1)
    assert c.responses.retrieve(ids[-1]).id == ids[-1]
    c.responses.delete(ids[-1])
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(ids[-1])
    unstored = c.responses.create(model="test-model", input="x", max_output_tokens=1,
                                  store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)


@pytest.mark.parametrize(("body", "status", "param", "words"), [
    ({"model": "gpt-5"}, 404, "model", "gpt-5"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     400, "input", "'input_image' are not supported"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, 400, "input", "must be of type"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools", "'web_search' are not supported"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}}, 400, "text", "schema"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, 400,
     "tool_choice", "nope"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens", "max_output_tokens"),
    ({"truncation": "auto"}, 400, "truncation", "truncation"),
])
def test_bad_input_is_a_clear_400(server: LiveServer, body: dict[str, Any], status: int,
                                  param: str, words: str) -> None:
    response = httpx.post(f"{server.url}/v1/responses", timeout=30,
                          json={"model": "test-model", "input": "hi", **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert "\n" not in error["message"]
