"""`hybridkv bench offload --remote`: two replicas on a real redis-server (tiny Llama)."""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("redis")

from hybridkv.cli import main  # noqa: E402
from hybridkv.connector.offload.redis_tier import SEED_KEY  # noqa: E402
from hybridkv.models.demo import DemoShape, write_demo_model  # noqa: E402
from tests.redis_server import running_redis  # noqa: E402

TINY = DemoShape(layers=3, hidden=64, heads=2, kv_heads=1, head_dim=32, intermediate=128,
                 vocab=300)


@pytest.fixture
def redis_server(tmp_path):
    yield from running_redis(tmp_path)


@pytest.fixture(autouse=True)
def keep_torch_threads():
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_second_replica_loads_the_whole_prefix_from_redis(redis_server, capsys, tmp_path):
    model = str(write_demo_model(tmp_path / "llama", "llama", TINY))
    assert main(["bench", "offload", model, "--remote", redis_server.url, "--prefix-tokens",
                 "128", "--repeat", "1", "--threads", "1", "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    figures = json.loads(out)
    # Every prefix token of the remote case came from Redis, of the cpu case from the CPU
    # tier (promoted there by the remote load); the recompute case found nothing.
    assert figures["hit_tokens"] == {"remote": 128, "cpu": 128}
    assert all(t > 0 for t in figures["ttft_s"].values())
    assert figures["load"]["remote"]["bytes"] > 0 and figures["load"]["remote"]["load_gbps"] > 0
    stats = {t["tier"]: t for t in figures["offload_stats"]["tiers"]}
    assert stats["remote"]["hits"] > 0 and stats["remote"]["rejected"] == 0
    bench = figures["redis_benchmark"]
    if bench is not None:  # Debian's redis-server package brings redis-benchmark
        assert bench["clients_50"] and bench["pipelined_1"], bench
        assert bench["pipelined_1"]["gbps"] > 0
        assert figures["remote_load_fraction_of_redis_benchmark"] > 0
    # The run leaves the store as it found it: only the shared hash seed.
    assert redis_server.client().keys() == [SEED_KEY]
