"""A chat reply as every API reads it: reasoning (when the model thinks), content, and tool
calls, whole or as it streams.

    model's text --ReasoningParser--> reasoning
                                  \\--> content --CallStream--> content shown, or tool calls

Each API adapter writes these three parts in its own wire format; none parses the model's
text itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridkv.server.reasoning import ReasoningParser, Split
from hybridkv.server.tools import CallStream, ToolUse


@dataclass
class Reply:
    reasoning: str
    content: str
    calls: list[dict[str, Any]] | None  # OpenAI's tool_calls: {"id", "type", "function"}


class ReplyStream:
    """One streamed reply: `feed` gives the reasoning and content to send now; `finish`
    what is left, and the tool calls, once the reply ends."""

    def __init__(self, use: ToolUse, *, thinks: bool, inside: bool) -> None:
        self._reasoning = ReasoningParser(inside=inside) if thinks else None
        self._calls = CallStream(use)

    def feed(self, text: str) -> Split:
        split = self._reasoning.feed(text) if self._reasoning else Split(content=text)
        return Split(split.reasoning, self._calls.feed(split.content) if split.content
                     else "")

    def finish(self) -> tuple[Split, list[dict[str, Any]] | None]:
        out = self._reasoning.finish() if self._reasoning else Split()
        content = self._calls.feed(out.content) if out.content else ""
        rest, calls = self._calls.finish()
        return Split(out.reasoning, content + rest), calls


def parse_reply(text: str, use: ToolUse, *, thinks: bool, inside: bool) -> Reply:
    stream = ReplyStream(use, thinks=thinks, inside=inside)
    head = stream.feed(text)
    tail, calls = stream.finish()
    return Reply(head.reasoning + tail.reasoning, head.content + tail.content, calls)
