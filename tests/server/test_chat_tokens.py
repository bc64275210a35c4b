"""Chat prompts are tokenized as transformers' `apply_chat_template(..., tokenize=True)` does:
the rendered text without the tokenizer's own special tokens, so that a template printing
`{{ bos_token }}` (Gemma's, Llama's) gives one BOS, not two."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from hybridkv.models.demo import CHAT_TEMPLATE
from tests.server.conftest import live_server

transformers = pytest.importorskip("transformers")

# The shipped template (the demo model's) and ones printing the BOS as Gemma's and Llama 3's.
TEMPLATES = {
    "demo": CHAT_TEMPLATE,
    "gemma": "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
             "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
             "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
    "llama3": "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
              "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
              "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
              "\n\n{% endif %}",
}
MESSAGES = [{"role": "user", "content": "Hello, fox!"},
            {"role": "assistant", "content": "One, two."},
            {"role": "user", "content": "Three?"}]


@pytest.fixture(scope="module")
def bos_model(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model with a tokenizer whose post-processor adds a BOS (id 0, '<pad>'
    standing in for it) to every encoded text, as Gemma's and Llama's do."""
    path = tmp_path_factory.mktemp("bos") / "model"
    shutil.copytree(demo_dir, path)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    bos = next(t for t in tokenizer["added_tokens"] if t["id"] == 0)["content"]
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                                                 {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [0], "tokens": [bos]}}}
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": bos}))
    return path


def reference_ids(model_dir: Path, template: str) -> list[int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    ids = tokenizer.apply_chat_template(MESSAGES, chat_template=template, tokenize=True,
                                        add_generation_prompt=True, return_dict=False)
    assert tokenizer("x")["input_ids"][0] == 0  # plain text does get the BOS
    return list(ids)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_chat_prompts_tokenize_as_transformers_does(bos_model: Path, name: str) -> None:
    expected = reference_ids(bos_model, TEMPLATES[name])
    assert expected.count(0) == (name != "demo")  # one BOS where the template prints it
    with live_server(bos_model, chat_template=TEMPLATES[name]) as live, \
            live.client() as client:
        tokens = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        assert tokens == expected
        # A plain prompt still gets the tokenizer's BOS.
        assert client.post("/tokenize", json={"prompt": "x"}).json()["tokens"][0] == 0
        reply: Any = client.post("/v1/chat/completions", json={
            "model": "test-model", "messages": MESSAGES, "max_tokens": 1}).json()
        assert reply["usage"]["prompt_tokens"] == len(expected)
