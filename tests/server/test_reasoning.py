"""Reasoning kept apart: the `<think>` parser on its own (streamed in any pieces, it splits as
it does whole), and a demo model whose template thinks, served through every API: the
reasoning in reasoning_content, thinking blocks, Ollama's thinking and reasoning items, the
answer apart, streamed and not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hybridkv.server.reasoning import (
    ReasoningParser,
    Split,
    reasoning_enabled,
    split_reply,
    starts_inside,
)
from tests.server.apis import WEATHER_PARAMETERS, chat_prompt, validates, write_thinking_model
from tests.server.conftest import LiveServer, greedy, live_server

MESSAGES = [{"role": "user", "content": "hi"}]
NUM_TOKENS = 12


@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), [
    ("<think>a plan</think>\n\nthe answer", False, "a plan", "the answer"),
    ("  <think>\nplan</think>answer", False, "plan", "answer"),
    ("no thinking at all", False, "", "no thinking at all"),
    ("<thin", False, "", "<thin"),  # ended before the tag did: it was text
    ("\nplan</think> answer", True, "plan", "answer"),
    ("still thinking when cut", True, "still thinking when cut", ""),
    ("plan </thi", True, "plan </thi", ""),
    ("a</think>b</think>c", True, "a", "b</think>c"),
    ("", True, "", ""),
])
def test_the_split_streamed_in_any_pieces_equals_the_whole(text: str, inside: bool,
                                                           reasoning: str,
                                                           content: str) -> None:
    assert split_reply(text, inside=inside) == Split(reasoning, content)
    for size in (1, 2, 3, 5):
        parser = ReasoningParser(inside=inside)
        got = Split()
        for i in range(0, len(text), size):
            got += parser.feed(text[i:i + size])
        got += parser.finish()
        assert got == Split(reasoning, content), size


def test_which_parser_runs() -> None:
    assert reasoning_enabled("auto", "{{ x }}<think>\n") is False  # opens, never closes
    assert reasoning_enabled("auto", "...</think>...") is True
    assert reasoning_enabled("auto", None) is False
    assert reasoning_enabled("none", "...</think>...") is False
    assert reasoning_enabled("qwen3", None) is True
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'; supported: auto"):
        reasoning_enabled("r1", None)
    assert starts_inside("<|im_start|>assistant\n<think>\n")
    assert not starts_inside("<think>old</think> new turn")


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_thinking_model(tmp_path_factory.mktemp("thinking") / "model", MESSAGES)


@pytest.fixture(scope="module")
def server(thinking_dir: Path) -> Iterator[LiveServer]:
    with live_server(thinking_dir) as live:
        yield live


@pytest.fixture(scope="module")
def expected(server: LiveServer, thinking_dir: Path) -> Split:
    """The model's own text, split by hand at its first </think>."""
    from hybridkv import LLM
    from tests.server.conftest import ENGINE_OPTIONS

    llm = LLM(str(thinking_dir), **ENGINE_OPTIONS)
    [raw] = greedy(llm, [chat_prompt(server, MESSAGES)], NUM_TOKENS)
    llm.engine.close()
    reasoning, found, content = raw.text.partition("</think>")
    assert found and reasoning.strip() and content.strip()
    return Split(reasoning.lstrip(), content.lstrip())


def test_chat_completions(server: LiveServer, expected: Split) -> None:
    import openai

    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    body: dict[str, Any] = dict(model="test-model", messages=MESSAGES, temperature=0,
                                max_tokens=NUM_TOKENS)
    message = c.chat.completions.create(**body).choices[0].message
    assert message.content == expected.content
    assert message.reasoning_content == expected.reasoning == message.reasoning  # type: ignore[attr-defined]
    reasoning = content = ""
    for chunk in c.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert Split(reasoning, content) == expected


def test_anthropic_messages(server: LiveServer, expected: Split) -> None:
    anthropic = pytest.importorskip("anthropic")
    c = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    body: dict[str, Any] = dict(model="test-model", messages=MESSAGES, max_tokens=NUM_TOKENS,
                                extra_body={"temperature": 0})
    with c.messages.stream(**body) as stream:
        streamed = stream.get_final_message()
    for reply in (c.messages.create(**body), streamed):
        assert [block.type for block in reply.content] == ["thinking", "text"]
        assert reply.content[0].thinking == expected.reasoning
        assert reply.content[1].text == expected.content
    hidden = c.messages.create(**body, thinking={"type": "disabled"})
    assert [block.type for block in hidden.content] == ["text"]


def test_ollama(server: LiveServer, expected: Split) -> None:
    ollama = pytest.importorskip("ollama")
    c = ollama.Client(host=server.url)
    body: dict[str, Any] = dict(model="test-model", messages=MESSAGES,
                                options={"temperature": 0, "num_predict": NUM_TOKENS})
    reply = c.chat(**body)
    assert Split(reply.message.thinking, reply.message.content) == expected
    parts = list(c.chat(**body, stream=True, think=True))
    assert Split("".join(p.message.thinking or "" for p in parts),
                 "".join(p.message.content for p in parts)) == expected
    assert "thinking" in c.show("test-model").capabilities
    assert c.chat(**body, think=False).message.thinking is None


def test_responses(server: LiveServer, expected: Split) -> None:
    import openai

    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    body: dict[str, Any] = dict(model="test-model", input=MESSAGES, temperature=0,
                                max_output_tokens=NUM_TOKENS)
    response = c.responses.create(**body)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == expected.reasoning
    assert response.output_text == expected.content
    events = list(c.responses.create(**body, stream=True))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    content = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert Split(reasoning, content) == expected
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == \
        ["reasoning", "message"]


def test_none_leaves_the_text_whole(thinking_dir: Path, expected: Split) -> None:
    import openai

    with live_server(thinking_dir, reasoning_parser="none") as live:
        c = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        message = c.chat.completions.create(model="test-model", messages=MESSAGES,  # type: ignore[arg-type]
                                            temperature=0, max_tokens=NUM_TOKENS
                                            ).choices[0].message
    assert "</think>" in (message.content or "")
    assert getattr(message, "reasoning_content", None) is None


def test_a_forced_call_has_no_room_to_think(server: LiveServer) -> None:
    """The grammar holds the reply to the call from its first token: nothing is read as
    reasoning, in the OpenAI adapter and in the core the others share."""
    import openai

    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    tool = {"type": "function", "function": {"name": "get_weather",
                                             "parameters": WEATHER_PARAMETERS}}
    message = c.chat.completions.create(model="test-model", messages=MESSAGES,  # type: ignore[arg-type]
                                        tools=[tool], tool_choice="required",  # type: ignore[list-item]
                                        temperature=0).choices[0].message
    assert message.tool_calls and getattr(message, "reasoning_content", None) is None
    assert validates(json.loads(message.tool_calls[0].function.arguments),
                     WEATHER_PARAMETERS)
    anthropic = pytest.importorskip("anthropic")
    reply = anthropic.Anthropic(base_url=server.url, api_key="unused").messages.create(
        model="test-model", max_tokens=120, messages=MESSAGES, tool_choice={"type": "any"},
        tools=[{"name": "get_weather", "input_schema": WEATHER_PARAMETERS}],
        extra_body={"temperature": 0})
    assert [block.type for block in reply.content] == ["tool_use"]
    assert validates(reply.content[0].input, WEATHER_PARAMETERS)
