import json

import pytest

pytest.importorskip("torch")

from hybridkv.cli import main  # noqa: E402


def test_bench_fast_prefill_reports_both_cases_with_equal_tokens(capsys):
    assert main(["bench", "fast-prefill", "--prompt-len", "256", "--mixed-lens", "96", "40",
                 "--layers", "8", "--hidden", "64", "--repeat", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["num_layers"], result["num_shared_layers"]) == (8, 3)
    for case, tokens in (("single", 256), ("mixed", 136)):
        figures = result[case]
        assert figures["num_tokens"] == tokens and figures["same_tokens"]
        for key in ("shared_layers_ms", "forward_ms"):
            assert set(figures[key]) == {"on", "off"} and min(figures[key].values()) > 0
        assert figures["shared_layers_ratio"] == pytest.approx(
            figures["shared_layers_ms"]["on"] / figures["shared_layers_ms"]["off"])
    assert result["shared_layers_ratio"] == result["single"]["shared_layers_ratio"]
    assert "forward_ratio" in result


def test_bench_fast_prefill_needs_a_kv_sharing_model(tmp_path, capsys):
    assert main(["demo-model", str(tmp_path / "m"), "--arch", "llama", "--layers", "2"]) == 0
    capsys.readouterr()
    assert main(["bench", "fast-prefill", str(tmp_path / "m"), "--prompt-len", "32",
                 "--mixed-lens", "8", "--repeat", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kv_sharing_fast_prefill needs a model" in err
