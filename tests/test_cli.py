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
    assert set(leaves) == {("plan",), ("generate",), ("demo-model",), ("serve",), ("bench", "kv"),
                           ("bench", "throughput"), ("bench", "capacity"),
                           ("bench", "prefix"), ("bench", "fast-prefill"),
                           ("bench", "offload"), ("bench", "serve"), ("bench", "gguf"),
                           ("bench", "vllm"), ("bench", "kv-quant"), ("bench", "spec")}
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


def test_bench_vllm_refuses_what_it_cannot_compare(tmp_path, capsys):
    # One line each: not a model directory, no vLLM Python where it was told to look.
    assert main(["bench", "vllm", str(tmp_path / "nothing")]) != 0
    assert "not a model directory" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert main(["bench", "vllm", str(tmp_path), "--vllm-python",
                 str(tmp_path / "no-python")]) != 0
    err = capsys.readouterr().err
    assert "no vLLM Python" in err and len(err.strip().splitlines()) == 1


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


# KV offloading: plan shows what the tiers hold; generate passes its flags to the engine.

def test_plan_shows_each_offload_tier_in_bytes_and_tokens(tmp_path, capsys):
    disk = tmp_path / "kv"
    assert main(["plan", "gpt-oss-20b", "--kv-offload-cpu", "8GiB",
                 "--kv-offload-disk", f"{disk}:50GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # A tier holds every attention group's blocks: bytes per token summed over the groups.
    per_token = sum(g["block_bytes"] / g["block_size"] for g in plan["groups"])
    assert plan["offload_tiers"] == [
        {"tier": "cpu", "path": None, "capacity_bytes": 8 << 30,
         "capacity_tokens": int((8 << 30) // per_token), "capacity_state_checkpoints": None},
        {"tier": "disk", "path": str(disk), "capacity_bytes": 50 << 30,
         "capacity_tokens": int((50 << 30) // per_token),
         "capacity_state_checkpoints": None}]
    assert not disk.exists()  # plan only reads the spec
    assert main(["plan", "gpt-oss-20b", "--kv-offload-cpu", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert "offload tier" in out and f"{int((8 << 30) // per_token):,}" in out


def test_plan_says_a_tier_holds_state_as_checkpoints(capsys):
    assert main(["plan", "Nemotron-H-8B-Base-8K", "--kv-offload-cpu", "8GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    state = sum(g["block_bytes"] for g in plan["groups"] if g["kind"] == "mamba")
    [cpu] = plan["offload_tiers"]
    assert cpu["capacity_state_checkpoints"] == (8 << 30) // state
    assert main(["plan", "Nemotron-H-8B-Base-8K", "--kv-offload-cpu", "8GiB"]) == 0
    assert "holds their state as checkpoints" in capsys.readouterr().out


@pytest.mark.parametrize("argv, expected", [
    (["--kv-offload-disk", "/mnt/kv"], "'/mnt/kv' has no size: write it as DIR:SIZE"),
    (["--kv-offload-disk", ":8GiB"], "has an empty path"),
    (["--kv-offload-disk", "/mnt/kv:0"], "the size must be more than 0 bytes"),
    (["--kv-offload-disk", "/mnt/kv:lots"], "cannot read 'lots'"),
    (["--kv-offload-cpu", "lots"], "cannot read 'lots' as a memory size"),
])
def test_plan_refuses_a_bad_tier_in_one_line(capsys, argv, expected):
    assert_one_line_error(capsys, ["plan", "gpt-oss-20b", *argv], "hybridkv plan: error:",
                          expected)


def test_plan_with_tiers_runs_with_torch_blocked(tmp_path):
    code = BLOCK_TORCH + f"""
from hybridkv.cli import main
assert main(["plan", "gpt-oss-20b", "--kv-offload-cpu", "1GiB",
             "--kv-offload-disk", "{tmp_path}/kv:1GiB"]) == 0
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "offload tier" in out.stdout


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    pytest.importorskip("torch")
    from hybridkv.models.demo import DemoShape, write_demo_model

    return str(write_demo_model(tmp_path_factory.mktemp("cli") / "llama", "llama", DemoShape(
        layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, intermediate=128, vocab=300)))


def test_generate_with_offload_tiers(tiny_model, tmp_path, capsys):
    disk = tmp_path / "kv"
    prompt = "the quick brown fox jumps over the lazy dog " * 8  # a few full blocks
    argv = ["generate", tiny_model, "--prompt", prompt, "--max-tokens", "3",
            "--kv-offload-cpu", "16MiB", "--kv-offload-disk", f"{disk}:64MiB", "--json"]
    for store in ("evict", "fill"):
        assert main([*argv, "--kv-offload-store", store]) == 0
        [line] = capsys.readouterr().out.splitlines()
        assert len(json.loads(line)["token_ids"]) == 3
    # fill: the prompt's full blocks were written to the disk tier before the process ended.
    assert any(p.suffix == ".kv" for p in disk.iterdir())


@pytest.mark.parametrize("argv, expected", [
    (["--kv-offload-cpu", "lots"], "argument --kv-offload-cpu: cannot read 'lots'"),
    (["--kv-offload-disk", "nosize"], "argument --kv-offload-disk: 'nosize' has no size"),
    (["--kv-offload-store", "never"], "argument --kv-offload-store: invalid choice: 'never'"),
])
def test_generate_refuses_bad_offload_flags_in_one_line(tmp_path, capsys, argv, expected):
    assert_one_line_error(capsys, ["generate", str(tmp_path), "--prompt", "hi", *argv],
                          "hybridkv generate: error:", expected)


def test_generate_refuses_offload_the_engine_cannot_run(tiny_model, tmp_path, capsys):
    base = ["generate", tiny_model, "--prompt", "hi"]
    assert_one_line_error(capsys, [*base, "--kv-offload-cpu", "10"],
                          "CPU offload budget of 10 B is smaller than one block")
    assert_one_line_error(capsys, [*base, "--kv-offload-cpu", "1GiB", "--no-prefix-caching"],
                          "need enable_prefix_caching")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert_one_line_error(capsys, [*base, "--kv-offload-disk", f"{blocker}/kv:1GiB"],
                          "kv_offload_disk:", str(blocker), "Not a directory")
