"""The real chat model (SmolLM2-135M-Instruct, a GGUF installed from PyPI) served over HTTP and
asked through the official openai client; the chat template and special tokens come from the
file. Gemma 3 270M's file has no template: its chat endpoint refuses in one line unless the
server is given one."""

from __future__ import annotations

import httpx
import pytest

from hybridkv.models.sources import real_model_path
from tests.server.conftest import live_server

openai = pytest.importorskip("openai")


def _model(name: str) -> str:
    try:
        real_model_path(name)
    except ValueError as e:
        pytest.skip(str(e))
    return name


def test_smollm2_answers_paris_through_the_openai_client():
    name = _model("smollm2-135m-instruct")
    with live_server(name, name=name, engine=dict(kv_cache_memory="64MiB")) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model=name, temperature=0, max_tokens=24,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content
        tokens = httpx.post(f"{server.url}/tokenize", json={"model": name, "messages": [
            {"role": "user", "content": "hi"}]}, timeout=30).json()["tokens"]
        # As transformers' apply_chat_template on the same file: nothing added before the
        # template's own <|im_start|> (id 1).
        import transformers

        path = real_model_path(name)
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        expected = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                           add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
        assert tokens[0] == 1 and tokens == list(expected)


def test_a_gguf_without_a_template_refuses_chat_in_one_line(tmp_path):
    name = _model("gemma-3-270m")
    with live_server(name, name=name, engine=dict(kv_cache_memory="64MiB")) as server:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
            "model": name, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400
        message = r.json()["error"]["message"]
        assert "--chat-template" in message and "\n" not in message
    template = tmp_path / "gemma.jinja"
    template.write_text(
        "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == "
        "'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
    with live_server(name, name=name, chat_template=str(template),
                     engine=dict(kv_cache_memory="64MiB")) as server:
        tokens = httpx.post(f"{server.url}/tokenize", json={"model": name, "messages": [
            {"role": "user", "content": "hi"}]}, timeout=30).json()["tokens"]
        assert tokens[:2] == [2, 105]  # one BOS, then <start_of_turn>
