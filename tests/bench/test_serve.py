import json
import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from hybridkv.bench.serve import make_prompts, percentiles  # noqa: E402
from hybridkv.cli import main  # noqa: E402

ENGINE = ["--max-model-len", "64", "--kv-cache-memory", "16MiB", "--max-num-seqs", "8",
          "--max-num-batched-tokens", "128"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hybridkv.models.demo import demo_shape, write_demo_model

    return str(write_demo_model(tmp_path_factory.mktemp("bench-serve") / "demo", "llama",
                                demo_shape("small")))


def test_prompts_share_the_prefix_and_percentiles_interpolate():
    prompts = make_prompts(3, 10, 4, 300, seed=1)
    assert [len(p) for p in prompts] == [10, 10, 10]
    assert prompts[0][:4] == prompts[1][:4] == prompts[2][:4]
    assert len({tuple(p[4:]) for p in prompts}) == 3
    assert all(4 <= t < 300 for p in prompts for t in p)
    assert make_prompts(3, 10, 4, 300, seed=1) == prompts
    assert percentiles([1.0, 2.0, 3.0, 4.0, 5.0], scale=1) == {
        "mean": 3.0, "p50": 3.0, "p90": 4.6, "p99": pytest.approx(4.96)}
    assert percentiles([])["p50"] is None


def test_bench_serve_in_process_every_request_streams_its_tokens(model_dir, capsys):
    assert main(["bench", "serve", "--model", model_dir, "--num-prompts", "3",
                 "--concurrency", "1", "2", "--input-len", "12", "--output-len", "4",
                 "--shared-prefix-len", "8", "--compare-offline", "--json",
                 "--offline-cpus", str(min(os.sched_getaffinity(0))), *ENGINE]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert [r["concurrency"] for r in figures["runs"]] == [1, 2]
    for run in figures["runs"]:
        assert run["completed"] == 3 and run["failed"] == 0 and run["errors"] == []
        assert run["short_outputs"] == 0
        assert run["output_tokens"] == [4, 4, 4]
        assert run["total_output_tokens"] == 12 and run["total_input_tokens"] == 36
        assert run["request_rate"] is None
        assert run["output_throughput"] > 0 and run["request_throughput"] > 0
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            assert set(run[key]) == {"mean", "p50", "p90", "p99"}
            assert 0 < run[key]["p50"] <= run[key]["p99"], key
        assert run["ttft_ms"]["p99"] <= run["e2e_ms"]["p99"]
    # One run alone: the 8 shared tokens are cached for later prompts only at block
    # granularity (16), so nothing is reused here; the figure is reported as is.
    assert all(r["cached_tokens"] >= 0 for r in figures["runs"])
    assert figures["offline"]["total_output_tokens"] == 12
    assert figures["offline"]["compared_run"] == 1
    assert figures["server_overhead"] == pytest.approx(
        figures["runs"][1]["output_throughput"] / figures["offline"]["output_throughput"])
    # Offline held to the server's 2 requests in flight, on the CPUs asked for.
    assert figures["offline_same_batch"]["total_output_tokens"] == 12
    assert figures["server_overhead_same_batch"] == pytest.approx(
        figures["runs"][1]["output_throughput"]
        / figures["offline_same_batch"]["output_throughput"])


def test_bench_serve_against_a_url_with_poisson_arrivals(model_dir, capsys):
    from hybridkv.bench.serve import server_in_process

    with server_in_process(model_dir, dict(max_model_len=64, kv_cache_memory="16MiB")) as url:
        assert main(["bench", "serve", "--url", url, "--model", model_dir,
                     "--num-prompts", "2", "--request-rate", "50", "--input-len", "40",
                     "--output-len", "4", "--shared-prefix-len", "32"]) == 0
    out = capsys.readouterr().out
    assert url in out and "out tok/s" in out
    row = out.splitlines()[3].split()
    assert row[:5] == ["-", "50.0", "no", "2", "0"]  # conc, rate, json, ok, failed


def test_bench_serve_counts_refused_and_short_requests(model_dir, capsys):
    from hybridkv.bench.serve import server_in_process

    with server_in_process(model_dir, dict(max_model_len=64, kv_cache_memory="16MiB")) as url:
        common = ["bench", "serve", "--url", url, "--vocab-size", "200", "--num-prompts", "2",
                  "--output-len", "8", "--json"]
        # A prompt of 70 tokens does not fit max_model_len 64: a 400 per request.
        assert main([*common, "--input-len", "70"]) == 0
        refused = json.loads(capsys.readouterr().out)["runs"][0]
        # 60 + 8 tokens do not fit either: refused too, not cut short at max_model_len.
        assert main([*common, "--input-len", "60"]) == 0
        too_long = json.loads(capsys.readouterr().out)["runs"][0]
    for run in (refused, too_long):
        assert run["failed"] == 2 and run["completed"] == 0
        assert run["errors"][0].startswith("HTTP 400")
        assert run["output_throughput"] == 0 and run["ttft_ms"]["p50"] is None
    assert "maximum context length" in too_long["errors"][0]


def test_compare_offline_with_a_url_needs_the_model(capsys):
    assert main(["bench", "serve", "--url", "http://127.0.0.1:1", "--compare-offline"]) == 2
    assert "needs --model" in capsys.readouterr().err


def test_bench_serve_structured_runs_each_setting_free_and_constrained(model_dir, capsys):
    """--structured: the same setting twice, the second with every request held to the JSON
    schema; both decode every token asked (the schema cannot end first)."""
    pytest.importorskip("llguidance")
    assert main(["bench", "serve", "--model", model_dir, "--num-prompts", "3",
                 "--input-len", "12", "--output-len", "6", "--structured", "--json",
                 *ENGINE]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert [r["structured"] for r in figures["runs"]] == [False, True]
    for run in figures["runs"]:
        assert run["completed"] == 3 and run["errors"] == []
        assert run["output_tokens"] == [6, 6, 6]
    assert main(["bench", "serve", "--workload", "conversations", "--structured"]) == 2
    assert "for the random workload only" in capsys.readouterr().err
