"""``pipeline.stage_context.ensure_ray`` sets up Ray Data for the stages' long batches: a generate
batch of 512-token answers may run past Ray Data's 30-minute no-progress limit on a small machine
(it did: the stage failed with ExecutionTimeoutError after 1,024 answers ran > 30 min), so the limit
is off unless the user sets it."""

from __future__ import annotations

import pytest
import ray

from pipeline import stage_context
from pipeline.config import load_config


@pytest.fixture
def fresh_context(monkeypatch):
    """ensure_ray against a stand-in ``ray.init`` (no cluster) and a fresh Ray Data context."""
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda *a, **k: None)
    # restored afterwards
    monkeypatch.setattr(stage_context, "_ray_started", stage_context._ray_started)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S", raising=False)
    ctx = ray.data.DataContext()
    monkeypatch.setattr(ray.data.DataContext, "get_current", staticmethod(lambda: ctx))
    return ctx


def test_no_progress_timeout_is_off_for_the_stages(fresh_context, monkeypatch):
    assert fresh_context.execution_no_progress_timeout_s > 0  # Ray's default: 1,800 s
    stage_context.ensure_ray(load_config("infra/configs/quickstart.yaml"))
    assert fresh_context.execution_no_progress_timeout_s == -1
    assert fresh_context.enable_progress_bars is False


def test_a_timeout_the_user_sets_is_kept(fresh_context, monkeypatch):
    monkeypatch.setenv("RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S", "7200")
    fresh_context.execution_no_progress_timeout_s = 7200.0  # what Ray reads from the variable
    stage_context.ensure_ray(load_config("infra/configs/quickstart.yaml"))
    assert fresh_context.execution_no_progress_timeout_s == 7200.0
