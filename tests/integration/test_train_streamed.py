"""``train.data_mode`` online and hybrid through ``pipeline/run.py`` on the tiny target (issue 23):
online trains from the feature stream and stores no cache; hybrid streams its first epoch while
writing the cache stage's own shards (the same bytes as the cache stage writes), then finishes
the cache and trains on from it; the held-out evaluations, checkpoints and the step count follow
the schedule in both."""

from __future__ import annotations

import json
import shutil

import pytest

from pipeline.cache.format import verify_shard

from .pipeline_config import tiny_pipeline_config
from .test_pipeline_e2e import run_pipeline

pytestmark = [pytest.mark.slow, pytest.mark.ray]
STREAM = ("--set", "train.eval_every=2", "--set", "train.checkpoint_every=2",
          "--set", "train.resume_from=latest", "--set", "train.num_epochs=3",
          "--set", "cache.rows_per_shard=3")


@pytest.fixture(scope="module")
def generated(tmp_path_factory, tiny_target_dir):
    """A run directory whose prompts and generate stages are done (copied by each test)."""
    root = tmp_path_factory.mktemp("streamed")
    config = tiny_pipeline_config(root, tiny_target_dir)
    proc = run_pipeline(config, "--stages", "prompts,generate")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def _copy(generated, tmp_path, tiny_target_dir):
    config = tiny_pipeline_config(tmp_path, tiny_target_dir)
    shutil.copytree(generated / "run", tmp_path / "run")
    return config


def _log(run):
    return [json.loads(l) for l in (run / "train" / "drafter" / "training_log.jsonl").open()]


def _samples(run) -> int:
    return sum(1 for l in (run / "generate" / "train.jsonl").open() if l.strip())


def test_online_trains_from_the_stream_and_stores_nothing(generated, tmp_path, tiny_target_dir):
    config = _copy(generated, tmp_path, tiny_target_dir)
    run = tmp_path / "run"
    proc = run_pipeline(config, "--stages", "cache,train", "--set", "train.data_mode=online",
                        *STREAM)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (run / "cache" / "manifest.json").exists()
    assert not list((run / "cache").rglob("*.parquet"))
    assert json.loads((run / "cache" / "_SUCCESS.json").read_text())["skipped"] == (
        "train.data_mode online")
    summary = json.loads((run / "train" / "_SUCCESS.json").read_text())
    per_epoch = _samples(run) // 2  # one sample per single-turn conversation, global batch 2
    assert summary["data_mode"] == "online" and summary["steps"] == 3 * per_epoch
    log = _log(run)
    assert [h["step"] for h in log] == list(range(1, 3 * per_epoch + 1))
    evals = [h for h in log if "heldout_tau" in h]
    assert evals and all(h["step"] % 2 == 0 or h["step"] == 3 * per_epoch for h in evals)
    assert all(h["heldout_tau"] >= 1.0 for h in evals)
    assert {h["epoch"] for h in log} == {0, 1, 2}
    assert (run / "train" / "drafter" / "config.json").exists()
    assert (run / "train" / "stream_errors.jsonl").exists()


def test_hybrid_writes_the_cache_stages_cache_and_trains_on_from_it(generated, tmp_path,
                                                                    tiny_target_dir):
    offline = tmp_path / "offline"
    offline.mkdir()
    proc = run_pipeline(_copy(generated, offline, tiny_target_dir), "--stages", "cache",
                        *STREAM)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hybrid = tmp_path / "hybrid"
    hybrid.mkdir()
    config = _copy(generated, hybrid, tiny_target_dir)
    proc = run_pipeline(config, "--stages", "cache,train", "--set", "train.data_mode=hybrid",
                        *STREAM)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = hybrid / "run"
    manifest = json.loads((run / "cache" / "manifest.json").read_text())
    reference = json.loads((offline / "run" / "cache" / "manifest.json").read_text())
    for split in ("train", "heldout"):
        assert [(s["file"], s["sha256"], s["rows"]) for s in manifest["splits"][split]["shards"]] \
            == [(s["file"], s["sha256"], s["rows"]) for s in reference["splits"][split]["shards"]]
        for shard in manifest["splits"][split]["shards"]:
            verify_shard(str(run / "cache"), split, shard)
    summary = json.loads((run / "train" / "_SUCCESS.json").read_text())
    per_epoch = manifest["splits"]["train"]["rows"] // 2
    assert summary["data_mode"] == "hybrid"
    assert summary["phases"]["streamed_steps"] == per_epoch
    assert summary["phases"]["cached_steps"] == 2 * per_epoch
    assert [h["step"] for h in _log(run)] == list(range(1, 3 * per_epoch + 1))
    # a later run of the same stages finds the cache finished and the training complete
    proc = run_pipeline(config, "--stages", "cache,train", "--set", "train.data_mode=hybrid",
                        *STREAM)
    assert proc.returncode == 0 and "stage train: complete, skipped" in proc.stderr
