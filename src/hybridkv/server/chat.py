"""Chat templates: where a model keeps its template, and rendering messages with it.

A template comes from `--chat-template` (a file, or the template text itself), else from
`chat_template.jinja` or the `chat_template` field of `tokenizer_config.json` in the model
directory, as Hugging Face stores them. Templates run in jinja2's sandbox: they come with
downloaded models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

NO_TEMPLATE = ("the model has no chat template (chat_template in tokenizer_config.json or "
               "chat_template.jinja; tokenizer.chat_template in a GGUF file) and the server "
               "was started without --chat-template: restart it with --chat-template FILE, "
               "or use /v1/completions")


class ChatTemplateError(ValueError):
    """The messages could not be rendered (a template's raise_exception, a bad template)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def find_chat_template(model_dir: str | Path, override: str | None = None) -> str | None:
    """The template text, or None when the model has none and none was given."""
    if override is not None:
        path = Path(override)
        return path.read_text(encoding="utf-8") if path.is_file() else override
    model_dir = Path(model_dir)
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config_path = model_dir / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def special_tokens(model_dir: str | Path) -> dict[str, str]:
    """bos_token / eos_token of tokenizer_config.json, which templates often print."""
    path = Path(model_dir) / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    found = {}
    for name in ("bos_token", "eos_token"):
        value = config.get(name) if isinstance(config, dict) else None
        if isinstance(value, dict):  # {"content": "<s>", ...}
            value = value.get("content")
        if isinstance(value, str):
            found[name] = value
    return found


class ChatTemplate:
    def __init__(self, source: str, variables: dict[str, str] | None = None) -> None:
        self.source = source
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        try:
            self._template = env.from_string(source)
            # Whether it renders tools itself (else the server describes them: tools.py).
            self.reads_tools = "tools" in meta.find_undeclared_variables(env.parse(source))
        except TemplateError as e:
            raise ValueError(f"the chat template does not parse: {e}") from None
        self._variables = variables or {}

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
               tools: list[dict[str, Any]] | None = None) -> str:
        try:
            return self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         tools=tools, **self._variables)
        except ChatTemplateError:
            raise
        except Exception as e:  # a template is user code: any failure is the request's
            raise ChatTemplateError(f"the chat template failed on these messages: "
                                    f"{type(e).__name__}: {e}") from None
