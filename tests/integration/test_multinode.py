"""The pipeline on a multi-node Ray cluster (``ray.cluster_utils.Cluster``: a CPU-less head and
two worker nodes on this machine), with the cache, the Ray Train checkpoints and the published
drafters on the moto S3 server. The two training workers run on different nodes
(``train.placement_strategy: STRICT_SPREAD``); once a checkpoint is on S3 a replacement node joins
and one of the training nodes is killed. Training must continue from that checkpoint (not from
step 0) and finish; calibration and evaluation then read the drafter from S3, with the run
directory's local copies deleted."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from .pipeline_config import ROOT, tiny_pipeline_config

pytestmark = [pytest.mark.slow, pytest.mark.ray]
BUCKET = "s3://dspark-test/multinode"
CHECKPOINT_EVERY = 3


def _pipeline(config, address, stages: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "pipeline" / "run.py"), "--config", str(config),
         "--stages", stages, "--set", f"ray.address={address}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: int = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.fixture
def cluster():
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 2, "object_store_memory": 150 * 2**20}
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                      "object_store_memory": 150 * 2**20})
    workers = [c.add_node(**node) for _ in range(2)]
    c.wait_for_nodes()
    yield c, workers, node
    c.shutdown()


def test_node_killed_mid_training_then_stages_read_the_drafter_from_s3(
        tmp_path, tiny_target_dir, s3_endpoint, cluster):
    import s3fs

    c, workers, node_args = cluster
    config = tiny_pipeline_config(tmp_path, tiny_target_dir, cache_output=f"{BUCKET}/cache",
                                  storage_options=s3_endpoint)
    cfg = yaml.safe_load(config.read_text())
    cfg["train"].update(num_epochs=12, checkpoint_every=CHECKPOINT_EVERY, max_failures=2,
                        placement_strategy="STRICT_SPREAD", storage_path=f"{BUCKET}/ckpt")
    config.write_text(yaml.safe_dump(cfg))
    fs = s3fs.S3FileSystem(**s3_endpoint)
    run = tmp_path / "run"

    proc = _pipeline(config, c.address, "prompts,generate,cache,train")
    deadline = time.monotonic() + 600
    while not fs.glob(f"{BUCKET}/ckpt/run/checkpoint_*/train_state.json"):
        assert proc.poll() is None, (proc.stdout.read() or "")[-4000:]
        assert time.monotonic() < deadline, "no checkpoint reached S3"
        time.sleep(0.2)
    c.add_node(**node_args)  # the replacement an autoscaler would start
    c.remove_node(workers[0], allow_graceful=False)  # hosts one of the two training workers
    _finish(proc)

    train_summary = json.loads((run / "train" / "_SUCCESS.json").read_text())
    log = [json.loads(l) for l in (run / "train" / "drafter" / "training_log.jsonl").open()]
    assert [h["step"] for h in log] == list(range(1, train_summary["steps"] + 1))
    resumed = [h["step"] for h in log if h["resumes"] >= 1]
    assert resumed, "no worker-group restart happened: the killed node hosted no worker?"
    first = resumed[0] - 1  # the checkpoint it continued from
    assert first > 0 and first % CHECKPOINT_EVERY == 0, first
    assert train_summary["published"] == f"{BUCKET}/ckpt/run/published/train"
    assert fs.exists(f"{BUCKET}/ckpt/run/published/train/config.json")

    # the run directory's drafters are gone: calibrate and eval can only read them from S3
    shutil.rmtree(run / "train" / "drafter")
    _finish(_pipeline(config, c.address, "calibrate"))
    assert fs.exists(f"{BUCKET}/ckpt/run/published/calibrate/config.json")
    shutil.rmtree(run / "calibrate" / "drafter")
    _finish(_pipeline(config, c.address, "eval"))
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["drafter"] == f"{BUCKET}/ckpt/run/published/calibrate"
    assert report["results"]["gsm8k"]["0.0"]["greedy_identical_share"] == 1.0
