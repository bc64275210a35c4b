"""What the tests of the Anthropic, Ollama and Responses adapters share: a tool whose
arguments are few enough for a random model to finish, the offline reference of a chat, and
a demo model whose template thinks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from tests.server.conftest import LiveServer

# Two tools described to the demo model's byte-level tokenizer take ~500 tokens.
LONG_CONTEXT = dict(max_model_len=2048, kv_cache_memory="32MiB")
WEATHER_PARAMETERS = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMETERS = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}


def chat_prompt(server: LiveServer, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt tokens of an OpenAI-form chat, as the server renders it."""
    response = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=30)
    assert response.status_code == 200, response.text
    return list(response.json()["tokens"])


def validates(arguments: dict[str, Any], schema: dict[str, Any]) -> bool:
    import jsonschema

    jsonschema.validate(arguments, schema)
    return True


# A template that drops earlier reasoning and opens the thinking in its generation prompt,
# as DeepSeek-R1's does.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'].split('</think>')[-1] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


def write_thinking_model(path: Path, messages: list[dict[str, str]], position: int = 3
                         ) -> Path:
    """A demo model whose template thinks, and whose tokenizer spells as `</think>` the
    token its greedy reply to `messages` writes at `position`: that reply is reasoning, then
    an answer. (The token's own text moves to an id the tokenizer did not use, and the
    prompt is checked to tokenize as before.)"""
    from tokenizers import Tokenizer

    from hybridkv import LLM, SamplingParams
    from hybridkv.models.demo import demo_shape, write_demo_model
    from hybridkv.server.chat import ChatTemplate
    from tests.server.conftest import ENGINE_OPTIONS

    model = write_demo_model(path, "llama", demo_shape("small"))
    text = ChatTemplate(THINKING_TEMPLATE).render(messages, add_generation_prompt=True)
    prompt = Tokenizer.from_file(str(model / "tokenizer.json")).encode(
        text, add_special_tokens=False).ids
    llm = LLM(str(model), **ENGINE_OPTIONS)
    [reply] = llm.generate([prompt], SamplingParams(max_tokens=position + 1,
                                                    temperature=0.0))
    llm.engine.close()
    closing = reply.token_ids[position]
    assert closing not in reply.token_ids[:position]
    config = json.loads((model / "tokenizer.json").read_text())
    vocab = config["model"]["vocab"]
    spelled = {v: k for k, v in vocab.items()}
    assert closing in spelled, "the reply's token is not one the tokenizer writes"
    vocab[spelled[closing]] = max(vocab.values()) + 1
    vocab["</think>"] = closing
    (model / "tokenizer.json").write_text(json.dumps(config))
    assert Tokenizer.from_file(str(model / "tokenizer.json")).encode(
        text, add_special_tokens=False).ids == prompt
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = THINKING_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return model
