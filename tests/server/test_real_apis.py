"""The real chat model (SmolLM2-135M-Instruct) through each API's official client: it
answers, and a forced tool call's arguments validate against the schema, in Anthropic's,
Ollama's and the Responses API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from hybridkv.models.sources import real_model_path
from tests.server.apis import WEATHER_PARAMETERS, validates
from tests.server.conftest import LiveServer, live_server

NAME = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    try:
        real_model_path(NAME)
    except ValueError as e:
        pytest.skip(str(e))
    with live_server(NAME, name=NAME, engine=dict(kv_cache_memory="64MiB")) as live:
        yield live


def test_anthropic(server: LiveServer) -> None:
    anthropic = pytest.importorskip("anthropic")
    c = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    reply = c.messages.create(model=NAME, max_tokens=24, messages=QUESTION,
                              extra_body={"temperature": 0})
    assert "Paris" in reply.content[0].text
    with c.messages.stream(model=NAME, max_tokens=200, messages=QUESTION, tools=[
            {"name": "get_weather", "description": "the weather in a city",
             "input_schema": WEATHER_PARAMETERS}], tool_choice={"type": "any"},
            extra_body={"temperature": 0}) as stream:
        called = stream.get_final_message()
    [call] = [block for block in called.content if block.type == "tool_use"]
    assert called.stop_reason == "tool_use" and validates(call.input, WEATHER_PARAMETERS)


def test_ollama(server: LiveServer) -> None:
    ollama = pytest.importorskip("ollama")
    c = ollama.Client(host=server.url)
    parts = list(c.chat(model=NAME, messages=QUESTION, stream=True,
                        options={"temperature": 0, "num_predict": 24}))
    assert "Paris" in "".join(p.message.content for p in parts)
    assert parts[-1].done and parts[-1].eval_count > 0


def test_responses(server: LiveServer) -> None:
    import openai

    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    first = c.responses.create(model=NAME, input=QUESTION, temperature=0,
                               max_output_tokens=24)
    assert "Paris" in first.output_text
    tool: Any = {"type": "function", "name": "get_weather", "description":
                 "the weather in a city", "parameters": WEATHER_PARAMETERS}
    called = c.responses.create(model=NAME, input="And its weather?", tools=[tool],
                                tool_choice="required", temperature=0,
                                previous_response_id=first.id, max_output_tokens=200)
    [call] = [item for item in called.output if item.type == "function_call"]
    assert validates(json.loads(call.arguments), WEATHER_PARAMETERS)
