"""Reasoning kept apart from the answer: `<think>...</think>`, as Qwen3, DeepSeek-R1 and
SmolLM3 write it.

    model's text            <think>Paris is in France.</think>\n\nParis.
    reasoning               Paris is in France.
    content                 Paris.

A template may open the thinking itself (DeepSeek-R1's generation prompt ends with
`<think>\n`): the reply then starts inside it, and a reply that never closes it is all
reasoning. Which parser runs is the server's `--reasoning-parser`; `auto` turns this one on
when the chat template writes `</think>`, so a model that does not think is left alone.
Every API shows the two parts its own way (reasoning_content, thinking blocks, reasoning
items, Ollama's `thinking`); streamed, the parser holds back only what could still be the
start of a tag.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Names of vLLM's and SGLang's `--reasoning-parser` for the same format, so that their
# command lines carry over.
REASONING_PARSERS = ("auto", "none", "think", "deepseek_r1", "qwen3", "smollm3")


def reasoning_enabled(name: str, template: str | None) -> bool:
    """Whether replies are split: a named parser always, `auto` when the template thinks."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; supported: "
                         f"{', '.join(REASONING_PARSERS)}")
    if name == "auto":
        return template is not None and THINK_CLOSE in template
    return name != "none"


def starts_inside(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves a `<think>` open (the reply continues it)."""
    head, found, tail = prompt_text.rpartition(THINK_OPEN)
    return bool(found) and THINK_CLOSE not in tail


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""

    def __iadd__(self, other: Split) -> Split:
        self.reasoning += other.reasoning
        self.content += other.content
        return self


def _held(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag` (held back until known)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """One reply's text, fed as it streams, split into reasoning and content.

        state      before --<think>--> thinking --</think>--> content
                   before --other text----------------------> content
    """

    def __init__(self, *, inside: bool) -> None:
        self.state = "thinking" if inside else "before"
        self._buffer = ""
        self._trim = inside  # whitespace that opens the reasoning is not shown

    def feed(self, text: str) -> Split:
        self._buffer += text
        out = Split()
        while self._buffer:
            if self.state == "before":
                head = self._buffer.lstrip()
                if head.startswith(THINK_OPEN):
                    self._buffer = head[len(THINK_OPEN):]
                    self.state, self._trim = "thinking", True
                elif THINK_OPEN.startswith(head):
                    return out  # still "<thi": wait for more
                else:
                    self.state = "content"
            elif self.state == "thinking":
                if self._trim:
                    self._buffer = self._buffer.lstrip()
                    if not self._buffer:
                        return out
                    self._trim = False
                reasoning, found, rest = self._buffer.partition(THINK_CLOSE)
                if found:
                    out.reasoning += reasoning
                    self._buffer, self.state, self._trim = rest, "content", True
                    continue
                keep = _held(self._buffer, THINK_CLOSE)
                out.reasoning += self._buffer[:len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return out
            else:
                if self._trim:  # the blank lines after </think>
                    self._buffer = self._buffer.lstrip()
                    if not self._buffer:
                        return out
                    self._trim = False
                out.content += self._buffer
                self._buffer = ""
        return out

    def finish(self) -> Split:
        """What is still held back, when the reply ends."""
        rest, self._buffer = self._buffer, ""
        if self.state == "thinking":
            return Split(reasoning=rest)
        return Split(content=rest if self.state == "content" or rest.strip() else "")


def split_reply(text: str, *, inside: bool) -> Split:
    parser = ReasoningParser(inside=inside)
    out = parser.feed(text)
    out += parser.finish()
    return out
