"""Structured output and tool calls over HTTP on the real SmolLM2-135M-Instruct, asked through
the official openai client: every constrained reply parses and validates against its schema;
bad specs are 400s naming the field, and the server keeps serving."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import pytest

from hybridkv.models.sources import real_model_path
from tests.server.conftest import live_server

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

NAME = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string",
                                                                 "maxLength": 30}},
                   "required": ["timezone"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]

# Nested objects, arrays, enums, bounded numbers, optional fields, recursion.
SCHEMAS = [
    {"type": "object", "properties": {
        "person": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 20},
            "address": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False}},
     "required": ["person"], "additionalProperties": False},
    {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                   "minItems": 1, "maxItems": 3}},
     "required": ["colors"], "additionalProperties": False},
    {"type": "object", "properties": {
        "temperature": {"type": "number", "minimum": -50, "maximum": 60},
        "count": {"type": "integer", "minimum": 1, "maximum": 10},
        "note": {"type": "string", "maxLength": 15}},
     "required": ["temperature", "count"], "additionalProperties": False},
    {"$defs": {"step": {"type": "object", "properties": {
        "action": {"type": "string", "maxLength": 20},
        "then": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/step"}]}},
        "required": ["action", "then"], "additionalProperties": False}},
     "$ref": "#/$defs/step"},
    {"type": "array", "items": {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "kind": {"const": "item"}},
        "required": ["ok", "kind"], "additionalProperties": False},
     "minItems": 1, "maxItems": 3},
]


class Answer(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population_millions: float
    kind: Literal["capital", "town"]


@pytest.fixture(scope="module")
def server():
    try:
        real_model_path(NAME)
    except ValueError as e:
        pytest.skip(str(e))
    with live_server(NAME, name=NAME, engine=dict(kv_cache_memory="64MiB",
                                                    max_model_len=1024)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def test_parse_returns_the_pydantic_object(client):
    completion = client.chat.completions.parse(
        model=NAME, temperature=0, max_tokens=120, response_format=Answer,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    answer = completion.choices[0].message.parsed
    assert isinstance(answer, Answer) and completion.choices[0].finish_reason == "stop"


def test_compile_and_mask_times_are_in_the_metrics(server, client):
    # Sampled, not greedy: a sampling row's mask is computed every step (a greedy row's only
    # when the grammar refuses its best tokens).
    client.completions.create(model=NAME, prompt="Pick:", max_tokens=5, temperature=1.0,
                              seed=0,
                              extra_body={"structured_outputs": {"choice": ["up", "down"]}})
    samples = server.metrics()
    assert samples["hybridkv:structured_output_compile_seconds_count"] >= 1
    assert samples["hybridkv:structured_output_mask_seconds_count"] >= 1


def test_a_varied_schema_set_always_validates(client):
    for i, schema in enumerate(SCHEMAS):
        # As applications do: the schema in the prompt too (the mask alone would let a
        # recursive schema nest until the tokens run out).
        ask = f"Reply with a small example of this JSON schema: {json.dumps(schema)}"
        if "$defs" in schema:
            ask = ('Reply with a plan of two steps as JSON, like {"action": "open", "then": '
                   '{"action": "close", "then": null}}')
        reply = client.chat.completions.create(
            model=NAME, temperature=0.7, seed=i, max_tokens=200, n=2,
            response_format={"type": "json_schema", "json_schema": {
                "name": f"s{i}", "schema": schema, "strict": True}},
            messages=[{"role": "user", "content": ask}])
        for choice in reply.choices:
            assert choice.finish_reason == "stop", (schema, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_on_chat_and_completions(server, client):
    reply = client.chat.completions.create(
        model=NAME, temperature=0, max_tokens=60, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give me a user profile as JSON."}])
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # out of tokens mid-object: still a prefix the grammar allowed
        assert reply.choices[0].message.content.startswith("{")
    done = client.completions.create(
        model=NAME, prompt="The answer is", max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert done.choices[0].text in ("yes", "no")
    regex = client.completions.create(
        model=NAME, prompt="A phone number:", max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert len(regex.choices[0].text) == 8 and regex.choices[0].text[3] == "-"


def test_a_batch_mixing_constrained_and_free_rows(server, client):
    """The free rows get the tokens they get alone: the mask touches only its own rows."""
    prompts = ["The capital of France is", "Once upon a time"]

    def free() -> list[str]:
        return [client.completions.create(model=NAME, prompt=p, max_tokens=16,
                                          temperature=0).choices[0].text for p in prompts]

    alone = free()
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        constrained = [pool.submit(client.completions.create, model=NAME, prompt=p,
                                   max_tokens=40, temperature=0, extra_body={
                                       "response_format": {"type": "json_schema",
                                                           "json_schema": {
                                                               "name": "x",
                                                               "schema": SCHEMAS[2]}}})
                       for p in prompts * 2]
        mixed = pool.submit(free)
        assert mixed.result() == alone
        for future in constrained:
            text = future.result().choices[0].text
            if future.result().choices[0].finish_reason == "stop":
                jsonschema.validate(json.loads(text), SCHEMAS[2])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_required_calls_a_tool(client, stream):
    kwargs = dict(model=NAME, temperature=0, max_tokens=80, messages=ASK_WEATHER,
                  tools=[WEATHER, TIME], tool_choice="required")
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        choice = reply.choices[0]
        calls, reason = choice.message.tool_calls, choice.finish_reason
        assert choice.message.content is None
    else:
        calls_by_index: dict[int, dict] = {}
        reason = None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                for delta in choice.delta.tool_calls or []:
                    call = calls_by_index.setdefault(delta.index, {"name": "", "args": ""})
                    if delta.id:
                        call["id"] = delta.id
                    call["name"] += delta.function.name or ""
                    call["args"] += delta.function.arguments or ""
                reason = choice.finish_reason or reason
        calls = [openai.types.chat.ChatCompletionMessageToolCall(
            id=c["id"], type="function", function={"name": c["name"], "arguments": c["args"]})
            for c in calls_by_index.values()]
    assert reason == "tool_calls" and len(calls) == 1
    call = calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_a_named_function_finishes_with_stop(client):
    reply = client.chat.completions.create(
        model=NAME, temperature=0, max_tokens=80, messages=ASK_WEATHER, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_auto_answers_or_calls(client, stream):
    """auto: the model decides. Whatever it writes comes back as content or as a call that
    parses, never as both; its tools reached the prompt (as a system message: SmolLM2's
    template has no tool support)."""
    kwargs = dict(model=NAME, temperature=0, max_tokens=60, messages=ASK_WEATHER,
                  tools=[WEATHER], tool_choice="auto")
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, calls, reason = choice.message.content, choice.message.tool_calls, \
            choice.finish_reason
    else:
        content, calls, reason = "", [], None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                calls += choice.delta.tool_calls or []
                reason = choice.finish_reason or reason
    if calls:
        assert reason == "tool_calls" and not content
        assert calls[0].function.name == "get_weather"
        json.loads(calls[0].function.arguments)
    else:
        assert content and reason in ("stop", "length")


def test_tools_reach_the_prompt_as_a_system_message(server):
    with server.client() as http:
        # The rendered prompt grows by the description of the tool.
        plain = http.post("/tokenize", json={"messages": ASK_WEATHER}).json()["count"]
        r = http.post("/v1/chat/completions", json={
            "messages": ASK_WEATHER, "tools": [WEATHER], "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > plain + 20


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format", "Invalid type"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format", "uniqueItems"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_object"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "jsn"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {
        "type": "json_object"}}, "tool_choice", "response_format"),
    ({"guided_json": {"type": "object"}}, "guided_json", "structured_outputs"),
    ({"guided_regex": "a+"}, "guided_regex", "structured_outputs"),
])
def test_bad_input_is_a_400_naming_the_field(server, body, param, words):
    with server.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": ASK_WEATHER,
                                                    "max_tokens": 4, **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"]
        assert "\n" not in error["message"]
        # And the server keeps serving.
        ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200


def test_legacy_field_on_completions_too(server):
    r = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
        "prompt": "Hi", "max_tokens": 2, "guided_choice": ["a", "b"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_choice"
