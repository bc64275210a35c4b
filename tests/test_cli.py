import json
import subprocess
import sys

from hybridkv.cli import main


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
