import json

import pytest

pytest.importorskip("torch")

from hybridkv.bench.offload import fit_kv_memory, kv_bytes  # noqa: E402
from hybridkv.cli import main  # noqa: E402
from hybridkv.models.demo import DemoShape, write_demo_model  # noqa: E402

# As small as a model can be and still be a Llama / a NemotronH (3 layers: M, -, *).
TINY = DemoShape(layers=3, hidden=64, heads=2, kv_heads=1, head_dim=32, intermediate=128,
                 vocab=300)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload-models")
    return {arch: str(write_demo_model(root / arch, arch, TINY))
            for arch in ("llama", "nemotron_h")}


@pytest.fixture(autouse=True)
def keep_torch_threads():
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def bench(capsys, *argv):
    # One thread: a tiny model gains nothing from two, and loses much when a core is busy.
    assert main(["bench", "offload", *argv, "--threads", "1", "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one JSON object, nothing else on stdout
    return json.loads(out)


@pytest.mark.parametrize("arch, store", [("llama", "evict"), ("nemotron_h", "fill")])
def test_ttft_cases_hit_the_tier_they_are_about(models, capsys, tmp_path, arch, store):
    figures = bench(capsys, models[arch], "--prefix-tokens", "256", "--repeat", "1",
                    "--store", store, "--disk-dir", str(tmp_path), "--cold-disk")
    assert figures["prefix_tokens"] == 256
    assert set(figures["ttft_s"]) == {"device", "cpu", "disk", "recompute"}
    assert all(seconds > 0 for seconds in figures["ttft_s"].values())
    # The whole prefix (256 tokens, 16 blocks) came from the tier each case is about; the
    # request that had to recompute found nothing anywhere.
    assert figures["hit_tokens"] == {"recompute": 0, "device": 256, "cpu": 256, "disk": 256}
    by_tier = figures["cached_tokens_by_tier"]
    assert by_tier["cpu"] == {"device": 0, "cpu": 256, "disk": 0, "remote": 0}
    assert by_tier["disk"] == {"device": 0, "cpu": 0, "disk": 256, "remote": 0}
    bandwidth = figures["bandwidth_gbps"]
    assert bandwidth["plain_copy"]["load"] > 0 and bandwidth["plain_copy"]["store"] > 0
    for tier in ("cpu", "disk"):
        assert bandwidth[tier]["load"] > 0 and bandwidth[tier]["store"] > 0
        assert bandwidth[tier]["bytes_loaded"] >= kv_bytes(_config(models[arch]), 256)
    assert figures["offload_stats"]["blocks_failed"] == 0
    assert list(tmp_path.iterdir()) == []  # the disk tier's directory is gone


def _config(model_dir):
    return fit_kv_memory(model_dir, 1 << 20, 64)[1]


def test_chat_trace_prefills_less_with_a_cpu_tier(models, capsys, tmp_path):
    figures = bench(capsys, models["llama"], "--prefix-tokens", "32", "--repeat", "1",
                    "--chat", "--conversations", "4", "--turns", "3", "--user-tokens", "48",
                    "--answer-tokens", "4", "--disk-dir", str(tmp_path))
    chat = figures["chat"]
    assert chat["oversubscription"] > 2  # the device holds well under the trace's KV
    configs = chat["configs"]
    assert set(configs) == {"off", "cpu_evict", "cpu_fill", "cpu_small_disk"}
    off = configs["off"]
    assert off["prefilled_tokens"] <= off["prompt_tokens"]
    for name in ("cpu_evict", "cpu_fill", "cpu_small_disk"):
        run = configs[name]
        assert run["prompt_tokens"] == off["prompt_tokens"]
        assert run["prefilled_tokens"] < off["prefilled_tokens"], name
        assert run["output_tokens"] == off["output_tokens"] == 4 * 3 * 4
        assert run["same_answers_as_off"], name  # reloaded KV is the KV computed
        assert run["blocks_stored"] > 0
    assert configs["cpu_evict"]["hit_tokens"]["cpu"] > 0
    assert configs["cpu_small_disk"]["hit_tokens"]["disk"] > 0
    # Fill copies every block it computes, evict only those leaving the device.
    assert configs["cpu_fill"]["blocks_stored"] >= configs["cpu_evict"]["blocks_stored"]


def test_the_table_names_every_case(models, capsys):
    assert main(["bench", "offload", models["llama"], "--prefix-tokens", "64",
                 "--repeat", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    for text in ("recompute", "device", "cpu", "disk", "GB/s", "from the page cache"):
        assert text in out
