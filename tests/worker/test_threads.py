"""torch's intra-op threads: chosen from the affinity mask, capped by OMP_NUM_THREADS, set
by the engine option."""

import os

import pytest
import torch

from hybridkv.config import EngineConfig
from hybridkv.worker.threads import affinity_cores, default_threads, set_intra_op_threads


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_default_is_the_affinity_mask(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_threads() == affinity_cores() == len(os.sched_getaffinity(0))


def test_a_narrower_mask_means_fewer_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert set_intra_op_threads(None) == 1 and torch.get_num_threads() == 1


def test_omp_num_threads_caps_the_default(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert default_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "16")
    assert default_threads() == 4


def test_an_explicit_count_wins(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert set_intra_op_threads(2) == 2 and torch.get_num_threads() == 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_bad_threads_option(bad):
    with pytest.raises(ValueError, match="threads must be an integer >= 1 or None"):
        EngineConfig(threads=bad)
