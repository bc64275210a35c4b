import json
import random

import pytest

pytest.importorskip("torch")
pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from hybridkv.bench.conversations import (  # noqa: E402
    BLOCK,
    Conversation,
    common_prefix,
    render_text,
    system_prompts,
)
from hybridkv.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hybridkv.models.demo import demo_shape, write_demo_model

    # Gemma 3: sliding-window layers (window 32) between global ones, the hybrid case.
    return str(write_demo_model(tmp_path_factory.mktemp("bench-conv") / "demo", "gemma3",
                                demo_shape("small")))


def play(variant: str, turns: int) -> list[list[dict[str, str]]]:
    conv = Conversation("sys", variant, random.Random(3), 1.0)
    sent = []
    for t in range(1, turns + 1):
        sent.append(conv.next_messages(t))
        conv.answered(f" answer {t}")
    return sent


def test_variants_build_the_conversations_they_name():
    resend = play("resend", 4)
    assert [len(m) for m in resend] == [2, 4, 6, 8]
    assert resend[3][:7] == [*resend[2], {"role": "assistant", "content": " answer 3"}]
    edit = play("edit", 3)
    assert [len(m) for m in edit] == [2, 2, 2]
    first, second = (m[1]["content"].split() for m in edit[:2])
    assert second[:len(first) // 2] == first[:len(first) // 2] and second != first
    branch = play("branch", 5)
    assert [len(m) for m in branch] == [2, 4, 6, 6, 6]
    assert branch[2][:5] == branch[3][:5] == branch[4][:5]  # turn 3's state
    assert len({m[5]["content"] for m in branch[2:]}) == 3
    assert play("branch", 5) == branch  # deterministic in the seed
    text = render_text(resend[1])
    assert text.startswith("System: sys\n\nUser: ") and text.endswith(
        "\nAssistant: answer 1\nUser: " + resend[1][3]["content"] + "\nAssistant:")
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([1], [1, 2]) == 1


def test_per_user_system_prompts_share_no_prefix():
    shared = system_prompts(0, "resend", 3, 40, 1.0)
    assert len(set(shared)) == 1 and len(shared[0].split()) == 40
    own = system_prompts(0, "resend", 3, 40, 1.0, per_user=True)
    assert [len(s.split()) for s in own] == [40, 40, 40]
    # No two users' prompts share more than a word or two (a random coincidence).
    assert all(common_prefix(a.split(), b.split()) <= 2
               for i, a in enumerate(own) for b in own[i + 1:])
    assert system_prompts(0, "resend", 3, 40, 1.0, per_user=True) == own  # deterministic
    assert system_prompts(1, "resend", 3, 40, 1.0, per_user=True) != own


def test_per_user_system_runs_and_is_reported(model_dir, capsys):
    assert main(["bench", "serve", "--model", model_dir, "--workload", "conversations",
                 "--users", "2", "--turns", "2", "--system-tokens", "48", "--per-user-system",
                 "--answer-tokens", "2", "--max-model-len", "512"]) == 0
    assert "2 users x 2 turns, per-user system prompts ~48 tokens" in capsys.readouterr().out
    assert main(["bench", "serve", "--model", model_dir, "--workload", "conversations",
                 "--users", "2", "--turns", "1", "--system-tokens", "48", "--per-user-system",
                 "--answer-tokens", "2", "--max-model-len", "512", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["per_user_system"] is True
    [run] = figures["runs"]
    # Nothing is shared: each user's first turn is recomputed past its first block at most.
    assert run["completed"] == 2 and all(
        r["recomputed"] >= r["prompt_tokens"] - BLOCK for r in run["requests"])


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_hybridkv_recomputes_at_most_a_block_past_the_new_tokens(model_dir, endpoint, capsys):
    # 4 turns: branch restarts from turn 3's state from turn 3 on, so turn 4 branches again.
    assert main(["bench", "serve", "--model", model_dir, "--workload", "conversations",
                 "--users", "2", "--turns", "4", "--system-tokens", "64",
                 "--answer-tokens", "6", "--variant", "resend", "edit", "branch",
                 "--endpoint", endpoint, "--max-model-len", "1024", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert [r["variant"] for r in figures["runs"]] == ["resend", "edit", "branch"]
    for run in figures["runs"]:
        assert run["completed"] == 8 and run["failed"] == 0, run["errors"]
        assert run["short_outputs"] == 0 and run["total_output_tokens"] == 48
        assert run["cache_reported"] and 0 < run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"]
        assert run["output_throughput"] > 0
        assert [t["turn"] for t in run["per_turn"]] == [1, 2, 3, 4]
        for r in run["requests"]:
            assert 0 < r["new_tokens"] <= r["new_vs_prompts"] <= r["prompt_tokens"]
            if r["turn"] > 1:
                # The caching property: every token of an earlier prompt of this user is
                # served from the cache but for the last partial block. (Answers of this
                # random-weight model do not re-tokenize to the tokens generated, so the
                # bound against prompt + answer text is not one a cache can promise.)
                assert r["recomputed"] <= r["new_vs_prompts"] + BLOCK, (run["variant"], r)
                assert r["recomputed"] < r["prompt_tokens"] - BLOCK, (run["variant"], r)
        assert run["max_excess_vs_prompts"] <= BLOCK
    # Edit never resends an answer: there the bound holds against everything sent before.
    assert figures["runs"][1]["max_excess"] <= BLOCK
