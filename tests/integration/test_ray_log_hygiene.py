"""The generate and cache stages' Ray Data calls, run on a local Ray with stand-ins for the model
actors, warn nothing: no deprecated argument (``concurrency``, ``ray_remote_args``, ``local://``)
and no ``filter(fn)`` performance hint (issue 24, item 6)."""

from __future__ import annotations

import json
import logging
import warnings

import numpy as np
import pytest

from pipeline.cache import stage as cache
from pipeline.config import CacheConfig, GenerateConfig
from pipeline.generate.hf import run_generate

from .conftest import conversations

pytestmark = [pytest.mark.slow, pytest.mark.ray]


class EchoUDF:
    """Stand-in for GenerateUDF: the conversation back, no model."""

    def __init__(self, **kwargs):
        pass

    def __call__(self, batch: dict) -> dict:
        n = len(batch["id"])
        return {"id": batch["id"], "domain": batch["domain"], "messages": batch["messages"],
                "finish_reasons": np.array(["[]"] * n, dtype=object),
                "error": np.array([""] * n, dtype=object)}


class SummaryWriter:
    """Stand-in for CacheWriterUDF: one summary per shard, no model and no file."""

    def __init__(self, **kwargs):
        pass

    def __call__(self, batch: dict) -> dict:
        return {"shard": batch["shard"], "path": batch["path"],
                "summary": np.array([json.dumps({"shard": int(s)}) for s in batch["shard"]],
                                    dtype=object)}


@pytest.fixture
def ray_warnings(ray_local):
    """Python warnings and Ray Data's logged warnings (Ray 2.51 logs the ``concurrency``
    deprecation rather than warning it) raised while the test runs."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    # Ray Data's loggers do not propagate to the "ray" logger
    loggers = [logging.getLogger(name) for name in ("ray", "ray.data")]
    for logger in loggers:
        logger.addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield records, caught
    for logger in loggers:
        logger.removeHandler(handler)


def _noise(records, caught) -> list[str]:
    messages = records + [f"{w.category.__name__}: {w.message}" for w in caught
                          if issubclass(w.category, (DeprecationWarning, UserWarning))]
    return [m for m in messages if "deprecated" in m.lower() or "instead of 'fn'" in m]


def test_generate_and_cache_calls_warn_nothing(tmp_path, ray_warnings, monkeypatch):
    records, caught = ray_warnings
    rows = [{"id": c["id"], "domain": c["domain"], "messages": c["messages"][:1]}
            for c in conversations(6)]
    counts = run_generate({"train": (rows, tmp_path / "gen.jsonl")}, tmp_path / "errors.jsonl",
                          GenerateConfig(batch_size=4, num_actors=1, cpus_per_actor=1,
                                         gpus_per_actor=0, num_threads=1, max_prompt_tokens=64),
                          target="-", dtype="float32", template_kwargs={}, seed=0, udf=EchoUDF)
    assert counts["train"]["generated"] == 6

    # the cache stage reads the generate output (a local JSONL file, read on this node)
    monkeypatch.setattr(cache, "CacheWriterUDF", SummaryWriter)
    summaries = cache.run_cache_split(
        str(tmp_path / "gen.jsonl"), str(tmp_path), "cache",
        cache.CacheTarget("-", "float32", [1], {}),
        CacheConfig(max_length=64, min_supervised_tokens=2, rows_per_shard=4,
                    rows_per_row_group=2, num_threads=1), storage_options={})
    assert summaries == [{"shard": 0}, {"shard": 1}]
    assert _noise(records, caught) == []


def test_the_check_sees_the_deprecated_forms(tmp_path, ray_warnings):
    """The fixture does catch what the project used to pass (so an empty list above means
    something)."""
    import ray

    records, caught = ray_warnings
    path = tmp_path / "lines.txt"
    path.write_text("a\nb\n")
    ray.data.read_text(f"local://{path}", ray_remote_args={"num_cpus": 0})
    ray.data.from_items([{"x": 1}]).map_batches(EchoUDF, concurrency=1)
    ray.data.from_items([{"x": 1}]).filter(lambda r: True)
    noise = _noise(records, caught)
    assert any("local://" in m for m in noise) and any("ray_remote_args" in m for m in noise)
    assert any("concurrency" in m for m in noise) and any("instead of 'fn'" in m for m in noise)
