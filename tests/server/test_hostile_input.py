"""Hostile requests over raw HTTP on a live server: each is refused with its status and a
one-line message naming what was wrong and what is accepted, quickly, and while it is in
flight the server goes on answering others (/health, a small completion).

The grammar cases run on the demo model's tokenizer (structured output needs no real
weights to be refused or accepted)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import LiveServer, live_server
from tests.server.test_errors import check_envelope

pytest.importorskip("llguidance")

C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
MIB = 1 << 20


def schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def refused_while_serving(server: LiveServer, path: str, body: Any, status: int,
                          param: str | None, *words: str, max_seconds: float = 10
                          ) -> dict[str, Any]:
    """Send `body` (a dict, bytes, or an iterator of byte chunks) from a thread; meanwhile
    /health and a small completion must be answered, /health within a second. Then the
    hostile request's error: its status, param, words, one line."""
    answer: dict[str, Any] = {}
    started = threading.Event()

    def hostile() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            start = time.monotonic()
            content = json.dumps(body).encode() if isinstance(body, dict) else body
            if isinstance(content, bytes):
                chunks = [content[i:i + MIB] for i in range(0, len(content), MIB)] or [b""]

                def upload() -> Iterator[bytes]:
                    for chunk in chunks:
                        yield chunk
                        started.set()

                headers = {"content-type": "application/json",
                           "content-length": str(len(content))}
                answer["response"] = http.post(path, content=upload(), headers=headers)
            else:  # chunked, without a Content-Length
                def stream() -> Iterator[bytes]:
                    for chunk in content:
                        yield chunk
                        started.set()

                answer["response"] = http.post(path, content=stream(),
                                               headers={"content-type": "application/json"})
            answer["seconds"] = time.monotonic() - start
        started.set()

    thread = threading.Thread(target=hostile)
    thread.start()
    try:
        assert started.wait(30)
        with server.client() as http:
            start = time.monotonic()
            health = http.get("/health", timeout=5)
            assert health.status_code == 200
            assert time.monotonic() - start < 1.0, "/health waited on the hostile request"
            small = http.post(C, json={"prompt": "the quick", "max_tokens": 2})
            assert small.status_code == 200, small.text
    finally:
        thread.join(60)
    response = answer["response"]
    check_envelope(response, status, param)
    message = response.json()["error"]["message"]
    assert "\n" not in message, message
    for word in words:
        assert word in message, message
    assert answer["seconds"] < max_seconds, answer["seconds"]
    return response.json()["error"]


@pytest.fixture(scope="module")
def server(demo_dir: Path) -> Iterator[LiveServer]:
    with live_server(demo_dir) as live:
        yield live


# ------------------------------------------------------------------ size and shape

def test_a_10_mb_prompt_is_refused_untokenized_while_health_answers(server: LiveServer
                                                                    ) -> None:
    big = "a " * 5_000_000
    error = refused_while_serving(server, C, {"prompt": big, "max_tokens": 1}, 400, "prompt",
                                  "10,000,000 characters", "maximum context length is 512",
                                  max_seconds=5)
    assert "longer than" in error["message"]
    # The same bound guards a prompt in a list, a chat and /tokenize.
    refused_while_serving(server, C, {"prompt": ["hi", big]}, 400, "prompt", "characters")
    refused_while_serving(server, CHAT, {"messages": [{"role": "user", "content": big}]},
                          400, "messages", "characters")
    refused_while_serving(server, "/tokenize", {"prompt": big}, 400, "prompt", "characters")


def test_a_body_over_the_limit_is_a_413_naming_the_limit_and_the_flag(server: LiveServer
                                                                      ) -> None:
    body = b'{"prompt": "' + b"a" * (33 * MIB) + b'"}'
    refused_while_serving(server, C, body, 413, None, "at most 32 MiB",
                          "--max-request-body-bytes")
    # Without a Content-Length it is counted as it arrives.
    chunks = iter([b'{"prompt": "'] + [b"a" * MIB] * 33 + [b'"}'])
    refused_while_serving(server, C, chunks, 413, None, "larger than 32 MiB",
                          "--max-request-body-bytes")


def test_the_body_limit_is_a_server_option(demo_dir: Path) -> None:
    with live_server(demo_dir, max_request_body_bytes=1000) as live, live.client() as http:
        response = http.post(C, json={"prompt": "x" * 2000})
        check_envelope(response, 413, None)
        assert "1,000 bytes" in response.json()["error"]["message"]
        assert http.post(C, json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_deeply_nested_json_is_a_400_saying_so(server: LiveServer) -> None:
    refused_while_serving(server, C, b"[" * 100_000 + b"]" * 100_000, 400, None,
                          "nests JSON more than 200 levels deep")
    deep = b'{"prompt": "x", "stop": ' + b"[" * 300 + b"]" * 300 + b"}"
    refused_while_serving(server, C, deep, 400, None, "more than 200 levels")


def test_top_logprobs_below_zero_names_top_logprobs(server: LiveServer) -> None:
    refused_while_serving(server, CHAT, {"messages": USER, "logprobs": True,
                                         "top_logprobs": -1},
                          400, "top_logprobs", "'top_logprobs'", "greater than or equal to 0")


def test_a_million_bad_items_are_refused_at_the_first(server: LiveServer) -> None:
    # pydantic would list every bad item, and FastAPI convert each: minutes on the loop.
    refused_while_serving(server, C, {"prompt": "x", "stop_token_ids": ["a"] * 1_000_000},
                          400, "stop_token_ids", "'stop_token_ids[0]' must be an integer",
                          max_seconds=5)
    refused_while_serving(server, C, {"prompt": "x", "logit_bias": {
        str(i): "high" for i in range(300_000)}}, 400, "logit_bias",
        "logit_bias[0] must be a number", max_seconds=5)
    refused_while_serving(server, C, {"prompt": [[1]] * 100_000}, 400, "prompt",
                          "more than 1,024 items")


# ------------------------------------------------------------------ unknown fields

@pytest.mark.parametrize(("body", "param", "path", "accepted"), [
    ({"response_format": {"type": "json_object", "foo": 1}}, "response_format",
     "response_format.foo", "type, json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {}, "foo": 1}}}, "response_format",
     "response_format.json_schema.foo", "name, description, schema, strict"),
    ({"structured_outputs": {"json": {}, "foo": 1}}, "structured_outputs",
     "structured_outputs.foo", "json, json_object, regex, choice, grammar"),
    ({"tools": [{"type": "function", "function": {"name": "f"}, "foo": 1}]}, "tools",
     "tools[0].foo", "type, function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "foo": 1}}]}, "tools",
     "tools[0].function.foo", "name, description, parameters, strict"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "function", "function": {"name": "f", "foo": 1}}}, "tool_choice",
     "tool_choice.function.foo", "name"),
    ({"stream_options": {"include_usage": True, "foo": 1}}, "stream_options",
     "stream_options.foo", "include_usage, continuous_usage_stats"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "foo": 1}]}]},
     "messages", "messages[0].content[0].foo", "type, text"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{
        "id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"},
        "index": 0}]}, *USER]}, "messages", "messages[0].tool_calls[0].index",
     "id, type, function"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {
        "name": "f", "arguments": "{}", "foo": 1}}]}, *USER]}, "messages",
     "messages[0].tool_calls[0].function.foo", "name, arguments"),
    ({"bogus": 1}, "bogus", "bogus", "model, temperature, top_p"),
], ids=lambda value: value if isinstance(value, str) and "." in value else None)
def test_unknown_fields_are_refused_at_every_depth(server: LiveServer, body: dict[str, Any],
                                                   param: str, path: str, accepted: str
                                                   ) -> None:
    refused_while_serving(server, CHAT, {"messages": USER, "max_tokens": 2, **body}, 400,
                          param, f"unknown field '{path}'", f"accepted: {accepted}")


def test_a_content_part_of_another_type_is_named(server: LiveServer) -> None:
    refused_while_serving(server, CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages",
        "'messages[0].content[0]'", "type 'image_url' are not supported", "accepted: text")


# ------------------------------------------------------------------ grammars

TREE = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
    "required": ["name", "children"], "additionalProperties": False}
LINKED = {"$defs": {"node": {"type": "object", "properties": {
    "value": {"type": "integer"},
    "next": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/node"}]}},
    "required": ["value", "next"], "additionalProperties": False}},
    "$ref": "#/$defs/node"}


@pytest.mark.parametrize(("schema", "words"), [
    ({"$ref": "#"}, ["no JSON value matches the schema", "'#'"]),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
      "$ref": "#/$defs/a"}, ["no JSON value matches the schema", "'#/$defs/a'"]),
    ({"type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]},
     ["would have to contain another without end"]),
    # A tree whose children must never be empty never ends either.
    ({**TREE, "properties": {**TREE["properties"], "children": {
        "type": "array", "items": {"$ref": "#"}, "minItems": 1}}},
     ["no JSON value matches"]),
    ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}},
     ["lists 10,000 properties", "at most 1,000"]),
    ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}},
     ["too many alternatives at one point", "optional properties"]),
    ({"$defs": {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
                for i in range(1200)} | {"d1200": {"type": "integer"}},
      "$ref": "#/$defs/d0"}, ["nests deeper than 1,000 levels counting each $ref"]),
    ({"type": "banana"}, ["Invalid type: banana"]),
], ids=["self", "a-b-a", "required-self", "nonempty-children", "10k-properties",
        "600-optional", "ref-chain", "banana"])
def test_a_schema_that_cannot_work_is_a_400_at_admission(server: LiveServer,
                                                         schema: dict[str, Any],
                                                         words: list[str]) -> None:
    for body in ({"response_format": schema_format(schema)},
                 {"structured_outputs": {"json": schema}}):
        param = next(iter(body))
        refused_while_serving(server, CHAT, {"messages": USER, "max_tokens": 4, **body}, 400,
                              param, *words)


def test_recursive_schemas_with_a_way_out_are_followed(server: LiveServer) -> None:
    with server.client() as http:
        for schema in (TREE, LINKED):
            response = http.post(CHAT, json={
                "messages": USER, "max_tokens": 60, "temperature": 0,
                "response_format": schema_format(schema)})
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            assert choice["finish_reason"] in ("stop", "length")
            if choice["finish_reason"] == "stop":
                json.loads(choice["message"]["content"])


def test_a_grammar_past_the_rule_limit_and_an_empty_one_are_400s(server: LiveServer) -> None:
    chain = "\n".join([f"r{i}: r{i + 1}" for i in range(3000)] + ['r3000: "a"', "start: r0"])
    refused_while_serving(server, C, {"prompt": "x", "structured_outputs": {
        "grammar": chain}}, 400, "structured_outputs", "3,002 rules and terminals",
        "at most 1,000")
    # Nothing ends it: the grammar engine forces "a" forever.
    refused_while_serving(server, C, {"prompt": "x", "structured_outputs": {
        "grammar": 'start: "a" start'}}, 400, "structured_outputs", "gives up on it")


BANANA = {"type": "function", "function": {"name": "f", "parameters": {"type": "banana"}}}


@pytest.mark.parametrize("tool_choice", [None, "auto", "none", "required",
                                         {"type": "function", "function": {"name": "f"}}])
def test_tool_parameters_are_checked_whatever_the_tool_choice(server: LiveServer,
                                                              tool_choice: Any) -> None:
    body: dict[str, Any] = {"messages": USER, "max_tokens": 4, "tools": [BANANA]}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    refused_while_serving(server, CHAT, body, 400, "tools",
                          "tools[0].function.parameters", "Invalid type: banana")
    looping = {**BANANA, "function": {**BANANA["function"], "parameters": {"$ref": "#"}}}
    refused_while_serving(server, CHAT, {**body, "tools": [looping]}, 400, "tools",
                          "tools[0].function.parameters", "no JSON value matches")


def test_tool_parameters_the_grammar_cannot_enforce_pass_when_not_enforced(
        server: LiveServer) -> None:
    unique = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True}}}}}
    with server.client() as http:
        auto = http.post(CHAT, json={"messages": USER, "max_tokens": 2, "tools": [unique]})
        assert auto.status_code == 200, auto.text
        required = http.post(CHAT, json={"messages": USER, "max_tokens": 2,
                                         "tools": [unique], "tool_choice": "required"})
        check_envelope(required, 400, "tools")
        assert "uniqueItems" in required.json()["error"]["message"]


# ------------------------------------------------------------------ off the event loop

# Jinja's sandbox refuses ranges past 100,000, so the ~3 s of work is three nested loops.
SLOW_TEMPLATE = ("{% for h in range(5) %}{% for i in range(100000) %}{% for j in range(25) %}"
                 "{% endfor %}{% endfor %}{% endfor %}"
                 "{{ messages[0]['content'] }}")


def test_a_slow_chat_template_never_holds_up_health(demo_dir: Path) -> None:
    """Templating (and tokenizing, on the same thread) runs off the event loop: while one
    chat's template takes seconds, /health and other requests are answered at once."""
    with live_server(demo_dir, chat_template=SLOW_TEMPLATE) as live:
        done: dict[str, Any] = {}

        def chat() -> None:
            with live.client() as http:
                start = time.monotonic()
                done["response"] = http.post(CHAT, json={"messages": USER, "max_tokens": 1})
                done["seconds"] = time.monotonic() - start

        thread = threading.Thread(target=chat)
        thread.start()
        time.sleep(0.2)
        with live.client() as http:
            for _ in range(3):
                start = time.monotonic()
                assert http.get("/health").status_code == 200
                assert time.monotonic() - start < 0.3
            completion = http.post(C, json={"prompt": "the quick", "max_tokens": 2})
            assert completion.status_code == 200
            assert "seconds" not in done, "the chat was not slow enough to tell"
        thread.join(60)
        assert done["response"].status_code == 200, done["response"].text
