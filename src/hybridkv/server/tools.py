"""Function calling: `tools` and `tool_choice` of a chat request.

A tool call is written by the model as one JSON object (optionally inside
`<tool_call>...</tool_call>`, as Hermes-style templates ask, or a list of such objects):

    {"name": "get_weather", "arguments": {"city": "Paris"}}

The chat template gets the tools as `tools=[{"type": "function", "function": {...}}]`, as
transformers passes them. A template that never reads `tools` (SmolLM2's, Gemma's) gets a
system message instead that lists them and asks for that JSON (`describe`).

    tool_choice   prompt shows tools   output                                finish_reason
    none          no                   text                                  stop / length
    auto          yes                  text, or a call if it parses as one   tool_calls
    required      yes                  constrained: a call to any tool       tool_calls
    {function}    yes                  constrained: a call to that tool      stop (as OpenAI)
"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass
from typing import Any

from hybridkv.server import protocol as p
from hybridkv.server.errors import bad_request

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_ANY_PARAMETERS: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolUse:
    """What a chat request does with its tools."""

    tools: tuple[Tool, ...]
    choice: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function tool_choice names

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none" and bool(self.tools)

    def finish_reason(self, reason: str | None, has_calls: bool) -> str | None:
        if has_calls and reason in ("stop", "length"):
            return "stop" if self.choice == "named" else "tool_calls"
        return reason

    def call_schema(self) -> dict[str, Any]:
        """The JSON schema a constrained reply follows: one call, its arguments checked
        against the function's parameters."""
        tools = [t for t in self.tools if self.choice != "named" or t.name == self.name]
        options = [{"type": "object", "properties": {
            "name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"], "additionalProperties": False}
            for t in tools]
        return options[0] if len(options) == 1 else {"anyOf": options}


def parse_tools(tools: list[p.Tool] | None, tool_choice: str | p.NamedToolChoice | None
                ) -> ToolUse:
    """The request's tools and tool_choice, checked: a 400 naming the field otherwise (their
    shapes are the protocol's; their parameters schemas, structured.check_tool_schemas)."""
    checked = tuple(_tool(i, t) for i, t in enumerate(tools or []))
    names = [t.name for t in checked]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise bad_request(f"tools: two tools are named {duplicate!r}", "tools")
    if tool_choice is None:
        return ToolUse(checked, "auto" if checked else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice must be none, auto, required or "
                              f'{{"type": "function", "function": {{"name": ...}}}}, got '
                              f"{tool_choice!r}", "tool_choice")
        if tool_choice != "none" and not checked:
            raise bad_request(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return ToolUse(checked, tool_choice)
    name = tool_choice.function.name
    if name not in names:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools "
                          f"({', '.join(names) or 'none given'})", "tool_choice")
    return ToolUse(checked, "named", name)


def _tool(index: int, tool: p.Tool) -> Tool:
    function = tool.function
    if not function.name:
        raise bad_request(f"tools[{index}].function.name is empty: every tool needs a name",
                          "tools")
    parameters = function.parameters if function.parameters is not None else _ANY_PARAMETERS
    return Tool(function.name, function.description or "", parameters)


def describe(tools: tuple[Tool, ...]) -> str:
    """The system text for a template without tool support."""
    listed = json.dumps([{"name": t.name, "description": t.description,
                          "parameters": t.parameters} for t in tools])
    return ("You can call these functions:\n" + listed + "\nTo call one, reply with only a "
            'JSON object: {"name": <function name>, "arguments": <its arguments>}.')


def render_call(call: p.MessageToolCall) -> str:
    """An assistant's earlier tool call (OpenAI's form) as the model writes one."""
    arguments: Any = call.function.arguments
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # else shown verbatim, as the client sent it
            arguments = json.loads(arguments)
    return json.dumps({"name": call.function.name, "arguments": arguments})


def parse_calls(text: str, use: ToolUse) -> list[dict[str, Any]] | None:
    """OpenAI `tool_calls` from the model's text, or None when the text is not a call to
    one of the tools (it is then the reply's content)."""
    body = text.strip()
    if body.startswith(TOOL_CALL_OPEN):
        body = body.removeprefix(TOOL_CALL_OPEN).strip()
        body = body.removesuffix(TOOL_CALL_CLOSE).strip()
    try:
        found = json.loads(body)
    except ValueError:
        return None
    items = found if isinstance(found, list) else [found]
    names = {t.name for t in use.tools}
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        # Llama-style "parameters" as well as "arguments".
        arguments = item.get("arguments", item.get("parameters", {}))
        if not isinstance(arguments, dict):
            return None
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": item["name"], "arguments": json.dumps(arguments)}})
    return calls or None


class CallStream:
    """One streamed choice: its text passes through as content until it could be a tool
    call (its first non-space character opens JSON or <tool_call>); from there it is held
    back and, at the end, sent as tool_calls deltas (or as content, if it does not parse)."""

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self.text = ""
        self.holding = use.constrained
        self._decided = use.constrained or not use.parses_calls

    def feed(self, new_text: str) -> str:
        """The content to send now."""
        self.text += new_text
        if self._decided:
            return "" if self.holding else new_text
        head = self.text.lstrip()
        if not head:
            return ""
        self._decided = True
        self.holding = head[0] in "{[" or TOOL_CALL_OPEN.startswith(head[:len(TOOL_CALL_OPEN)])
        return "" if self.holding else self.text

    def finish(self) -> tuple[str, list[dict[str, Any]] | None]:
        """(content still to send, the calls) when the choice ends."""
        if not self.holding and self._decided:
            return "", None
        calls = parse_calls(self.text, self.use) if self.use.parses_calls else None
        return ("" if calls else self.text), calls
