"""Unit tests run tiny models: one intra-op thread is fastest and avoids OpenMP spin contention
when other processes (Ray workers, a second test run) share the CPU cores."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
