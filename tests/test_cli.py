import argparse
import json
import subprocess
import sys

import pytest

from hybridkv import cli
from hybridkv.cli import main
from tests.kv.test_no_torch import BLOCK_TORCH


def test_plan_default_model_prints_a_table(capsys):
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "gemma-3-27b-it" in out and "max concurrency" in out


def test_plan_json_has_hybrid_and_no_hybrid_figures(capsys):
    assert main(["plan", "gpt-oss-20b", "--memory", "40GiB", "--max-num-batched-tokens",
                 "512", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["ideal_fraction"] >= 0.99
    assert plan["no_hybrid"]["max_concurrency"] < plan["max_concurrency"]
    assert plan["hybrid_gain"] > 1.9


def test_plan_errors_are_one_line(capsys):
    for argv in (["plan", "no-such-model"], ["plan", "gpt-oss-20b", "--memory", "0"],
                 ["plan", "gpt-oss-20b", "--memory", "1MiB"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("hybridkv plan: error:"), err


def test_console_script_rejects_bad_flags_without_a_traceback():
    out = subprocess.run([sys.executable, "-m", "hybridkv.cli", "plan", "--memory", "lots"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "cannot read 'lots'" in out.stderr


def test_plan_of_a_state_hybrid_shows_the_state_size(capsys):
    assert main(["plan", "Nemotron-H-8B-Base-8K", "--max-num-batched-tokens", "512",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    state = next(g for g in plan["groups"] if g["kind"] == "mamba")
    # 24 Mamba2 layers: conv [128*64 + 2*8*128, 3] + SSM [128, 64, 128], bf16.
    assert state["state_bytes_per_request"] == 24 * 2 * (10240 * 3 + 128 * 64 * 128)
    assert plan["block_size"] == 16 and plan["ideal_fraction"] >= 0.99


def test_plan_of_a_kv_sharing_model_shows_the_saving(capsys):
    assert main(["plan", "gemma-3n-E4B-it", "--memory", "8GiB", "--max-model-len", "32768",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # From first principles, bf16, 2 KV heads of 256 (2 KiB per token and layer): of 35
    # layers, 20 own a cache (4 full, 16 sliding with a 512-token window); 15 read theirs.
    per_layer = 2 * 2 * 256 * 2
    assert plan["ideal_bytes_per_token"] == 4 * per_layer + 16 * per_layer * 512 / 32768
    unshared = plan["without_kv_sharing"]
    assert unshared["ideal_bytes_per_token"] == 7 * per_layer + 28 * per_layer * 512 / 32768
    assert plan["max_concurrency"] > 1.7 * unshared["max_concurrency"]
    assert main(["plan", "gemma-3n-E4B-it"]) == 0
    assert "15 layers read another layer's KV" in capsys.readouterr().out


# Bad input: one line `hybridkv ...: error: ...` naming the input, status 2, no traceback.

def assert_one_line_error(capsys, argv, *expected):
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("hybridkv") and ": error: " in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
    return err


@pytest.mark.parametrize("flag, value, expected", [
    ("--temperature", "nan", "expected a finite number >= 0, got nan"),
    ("--temperature", "-1", "expected a finite number >= 0, got -1"),
    ("--top-p", "0", "expected a number in (0, 1]"),
    ("--top-k", "-2", "expected a whole number >= 0, got -2"),
    ("--seed", str(2**70), f"expected a seed in [0, 2**64), got {2**70}"),
    ("--seed", "-1", "expected a seed in [0, 2**64)"),
    ("--kv-cache-memory", "abc", "cannot read 'abc' as a memory size"),
    ("--kv-cache-memory", "inf", "cannot read 'inf' as a memory size"),
    ("--max-tokens", "0", "expected a whole number >= 1, got 0"),
])
def test_generate_refuses_bad_flags_in_one_line(tmp_path, capsys, flag, value, expected):
    assert_one_line_error(capsys, ["generate", str(tmp_path), "--prompt", "hi", flag, value],
                          "hybridkv generate: error: argument " + flag, expected)


def test_generate_names_a_prompts_file_that_is_not_utf8(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"caf\xe9 latin-1\n")
    assert_one_line_error(capsys, ["generate", str(tmp_path), "--prompts-file", str(prompts)],
                          f"{prompts}: not UTF-8 text")


def test_generate_names_a_missing_prompts_file(tmp_path, capsys):
    missing = tmp_path / "none.txt"
    assert_one_line_error(capsys, ["generate", str(tmp_path), "--prompts-file", str(missing)],
                          f"{missing}: No such file or directory")


def test_generate_names_a_missing_model_directory(tmp_path, capsys):
    pytest.importorskip("torch")
    assert_one_line_error(capsys, ["generate", str(tmp_path / "none"), "--prompt", "hi"],
                          str(tmp_path / "none"), "does not exist")


def test_plan_names_a_config_that_is_not_utf8_or_not_json(tmp_path, capsys):
    (tmp_path / "config.json").write_bytes(b'{"model_type": "caf\xe9"}')
    assert_one_line_error(capsys, ["plan", str(tmp_path)], str(tmp_path), "not UTF-8 text")
    (tmp_path / "config.json").write_text("{not json")
    assert_one_line_error(capsys, ["plan", str(tmp_path)], "not valid JSON")


def test_demo_model_refuses_bad_shapes_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "m"
    for argv, expected in (
            (["--heads", "3", "--kv-heads", "2"], "hidden 128 is not a multiple of heads 3"),
            (["--heads", "3", "--kv-heads", "2", "--head-dim", "32"],
             "heads 3 is not a multiple of kv-heads 2"),
            (["--head-dim", "33"], "head-dim 33 must be even"),
            (["--vocab", "100"], "vocab 100 is below"),
            (["--arch", "nemotron_h", "--head-dim", "48"], "hidden 128 is not a multiple of "
                                                           "head-dim 48"),
            (["--layers", "0"], "argument --layers: expected a whole number >= 1"),
            (["--seed", str(2**64)], "argument --seed: expected a seed in [0, 2**64)")):
        assert_one_line_error(capsys, ["demo-model", str(out), *argv], expected)
    assert list(tmp_path.iterdir()) == []


def test_bench_kv_names_a_bad_trace_file(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"prompt": [1, 2, 3]}\n{"tokens": [4]}\n')
    assert_one_line_error(capsys, ["bench", "kv", "--trace", str(trace)],
                          "hybridkv bench kv: error:", f"{trace}, line 2")


def test_a_missing_subcommand_or_unknown_flag_is_one_line(capsys):
    assert_one_line_error(capsys, [], "required: COMMAND")
    assert_one_line_error(capsys, ["bench"], "hybridkv bench: error:", "required: SUITE")
    assert_one_line_error(capsys, ["plan", "--bogus"], "unrecognized arguments: --bogus")


def test_console_script_refuses_a_huge_seed_without_a_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hybridkv.cli", "generate", str(tmp_path),
                          "--prompt", "hi", "--seed", str(2**70)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert "argument --seed" in out.stderr


def test_internal_errors_keep_their_traceback(monkeypatch):
    def broken(args):
        raise AttributeError("a bug, not bad input")

    monkeypatch.setattr(cli, "COMMANDS", (cli.Command("plan", "plan", lambda p: None, broken),))
    with pytest.raises(AttributeError, match="a bug"):
        main(["plan"])


# --help

def leaf_parsers(parser, path=()):
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        yield path, parser
    for action in subparsers:
        for name, sub in action.choices.items():
            yield from leaf_parsers(sub, (*path, name))


def test_every_option_has_help_showing_its_default():
    leaves = dict(leaf_parsers(cli.build_parser()))
    assert set(leaves) == {("plan",), ("generate",), ("demo-model",), ("bench", "kv"),
                           ("bench", "throughput"), ("bench", "capacity"),
                           ("bench", "prefix"), ("bench", "fast-prefill")}
    for path, parser in leaves.items():
        text = " ".join(parser.format_help().split())
        required_choice = {a for g in parser._mutually_exclusive_groups if g.required
                           for a in g._group_actions}
        for action in parser._actions:
            assert action.help, (path, action.dest)
            if action.required or action in required_choice or action.default in (
                    False, argparse.SUPPRESS):
                continue
            if action.default is None:  # the help says what happens without it
                assert "default" in action.help, (path, action.dest)
            else:
                assert "default" in action.help or f"(default: {action.default})" in text, (
                    path, action.dest)


def test_plan_help_lists_the_shipped_models(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["plan", "--help"])
    assert exit.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for name in ("gemma-3-27b-it", "gpt-oss-20b", "Nemotron-H-8B-Base-8K", "gemma-3n-E4B-it"):
        assert name in out


def test_plan_runs_with_torch_blocked():
    code = BLOCK_TORCH + """
from hybridkv.cli import build_parser, main
build_parser()  # every subcommand's options, bench suites included
assert main(["plan", "gpt-oss-20b"]) == 0
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "max concurrency" in out.stdout
