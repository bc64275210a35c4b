"""A chat on a model with state layers names where its last messages start (part points):
a later turn that replaces the last message (a branch, an edit) resumes from the state saved
there, and recomputes at most one block more than what is new. The official `openai`
client against a live server on a Mamba-2 hybrid."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.conftest import LiveServer, live_server

openai = pytest.importorskip("openai")

BLOCK = 16
SYSTEM = "You answer questions about the weather in the mountains, briefly. " * 6
HISTORY = [{"role": "system", "content": SYSTEM},
           {"role": "user", "content": "Will it rain tomorrow at the pass?"},
           {"role": "assistant", "content": "Probably in the afternoon, after two."}]
LAST = ("And what about the north face, where we plan to climb on Saturday morning with "
        "two friends and a dog?")
BRANCH = "Then what should we pack for the hut?"


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from hybridkv.models.demo import demo_shape, write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("part") / "hybrid", "nemotron_h",
                            demo_shape("small"))


@pytest.fixture(scope="module")
def server(hybrid_dir: Any) -> Iterator[LiveServer]:
    # One checkpoint at the prompt's end (no tail before it): without a part point the
    # state where the last message began is nowhere.
    with live_server(hybrid_dir, engine={"mamba_checkpoint_tail": 1}) as live:
        yield live


def ask(server: LiveServer, messages: list[dict[str, str]]) -> int:
    """The reply's cached prompt tokens."""
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    response = c.chat.completions.create(model="test-model", messages=messages,  # type: ignore[arg-type]
                                         max_completion_tokens=4, temperature=0)
    return int(response.usage.prompt_tokens_details.cached_tokens)


def tokens(server: LiveServer, messages: list[dict[str, str]], add: bool) -> list[int]:
    response = httpx.post(f"{server.url}/tokenize", json={
        "messages": messages, "add_generation_prompt": add})
    return list(response.json()["tokens"])


def test_a_branch_resumes_where_the_replaced_message_began(server: LiveServer) -> None:
    first = HISTORY + [{"role": "user", "content": LAST}]
    ask(server, first)
    branch = HISTORY + [{"role": "user", "content": BRANCH}]
    prompt, before = tokens(server, branch, True), tokens(server, HISTORY, False)
    shared = next(i for i, (a, b) in enumerate(zip(prompt, tokens(server, first, True),
                                                   strict=False)) if a != b)
    assert shared >= len(before) - 1 and len(prompt) - shared > BLOCK  # a real branch
    cached = ask(server, branch)
    # Resumed at the block where the replaced message began: at most one block and the
    # new tokens recomputed.
    assert cached == len(before) // BLOCK * BLOCK
    assert len(prompt) - cached <= len(prompt) - shared + BLOCK


def test_the_same_prompts_as_token_ids_name_no_part_points(server: LiveServer) -> None:
    """/v1/completions cannot know where messages start: the same two prompts sent as
    token ids resume from the first one's checkpoints only, before the branch."""
    history = [{**HISTORY[0], "content": "Another system prompt, about rivers. " * 8},
               *HISTORY[1:]]
    first = tokens(server, history + [{"role": "user", "content": LAST}], True)
    branch = tokens(server, history + [{"role": "user", "content": BRANCH}], True)
    before = tokens(server, history, False)
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    c.completions.create(model="test-model", prompt=first, max_tokens=4, temperature=0)
    again = c.completions.create(model="test-model", prompt=branch, max_tokens=4,
                                 temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens < len(before) // BLOCK * BLOCK
