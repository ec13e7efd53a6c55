"""Ray Train + DeepSpeed (ZeRO-1, gloo) on the tiny target: the loss goes down, held-out metrics
are logged, the final checkpoint is a loadable HF drafter directory, and resuming from a mid-run
checkpoint with a different worker count continues exactly where the uninterrupted run went."""

from __future__ import annotations

import json

import pytest

from drafters.config import DrafterConfig
from drafters.loading import load_drafter
from pipeline.cache.stage import CacheTarget, run_cache
from pipeline.cache.format import build_manifest
from pipeline.checkpoints import MARKER, inspect_checkpoint
from pipeline.config import CacheConfig, TrainConfig
from serve.engine.target_loading import load_target
from pipeline.train.driver import run_train

from .conftest import conversations

pytestmark = [pytest.mark.slow, pytest.mark.ray]
WANDB = {"project": "t", "entity": None, "mode": "offline"}


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory, tiny_target_dir, ray_local):
    root = tmp_path_factory.mktemp("cache")
    convs = conversations(10)
    splits = run_cache({"train": convs[:8], "heldout": convs[8:]}, str(root),
                       CacheTarget(str(tiny_target_dir), "float32", [1, 3], {}),
                       CacheConfig(max_length=256, min_supervised_tokens=5, rows_per_shard=4,
                                   rows_per_row_group=2, num_threads=1), {})
    manifest = build_manifest(target=str(tiny_target_dir), revision=None, layer_ids=[1, 3],
                              hidden_size=64, vocab_size=49152, template_sha256="x",
                              template_kwargs={}, max_length=256, splits=splits)
    return str(root), manifest


def _train(tiny_cache, tiny_target_dir, out_dir, drafter=None, **train):
    cache_dir, manifest = tiny_cache
    base = dict(num_workers=2, num_threads=1, micro_batch_size=2, global_batch_size=4, lr=3e-3,
                warmup_ratio=0.1, num_anchors=16)
    tc = TrainConfig(**{**base, **train})
    dc = DrafterConfig(num_layers=1, block_size=4, markov_rank=16, **(drafter or {}))
    result = run_train(cache_dir=cache_dir, manifest=manifest, out_dir=out_dir,
                       target=str(tiny_target_dir), layer_ids=[1, 3], drafter=dc, train=tc,
                       wandb_cfg=WANDB, storage_options={}, run_name="t")
    log = [json.loads(l) for l in (out_dir / "drafter" / "training_log.jsonl").open()]
    return result, log


#: one schedule for the uninterrupted run (loss and held-out checks) and for the run whose worker
#: is killed (it must end with the uninterrupted run's weights): 24 steps on 2 workers
UNINTERRUPTED = dict(num_epochs=12, eval_every=8, eval_rows=2, checkpoint_every=4, max_failures=1)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_cache, tiny_target_dir):
    """The training run of :data:`UNINTERRUPTED`: (its directory, result, log)."""
    out = tmp_path_factory.mktemp("uninterrupted") / "train"
    result, log = _train(tiny_cache, tiny_target_dir, out, **UNINTERRUPTED)
    return out, result, log


def test_two_workers_loss_goes_down(uninterrupted, tiny_target_dir):
    out, result, log = uninterrupted
    assert result["steps"] == 24  # 8 rows / global batch 4 = 2 optimizer steps per epoch
    assert [h["step"] for h in log] == list(range(1, 25))
    assert all(h["resumes"] == 0 for h in log)  # max_failures 1 must not have hidden a crash
    first = sum(h["loss"] for h in log[:4]) / 4
    last = sum(h["loss"] for h in log[-4:]) / 4
    assert last < 0.8 * first, (first, last)
    assert log[-1]["tau"] > log[0]["tau"]
    # held-out metrics every 8 steps, and they improve too
    evals = [h for h in log if "heldout_loss" in h]
    assert [h["step"] for h in evals] == [8, 16, 24]
    assert evals[-1]["heldout_loss"] < evals[0]["heldout_loss"]
    assert {"heldout_tau", "heldout_accept_rate@1", "accept_rate@4"} <= set(evals[-1])
    assert list((out / "wandb").rglob("offline-run-*"))
    target = load_target(str(tiny_target_dir))
    model = load_drafter(out / "drafter", target, str(tiny_target_dir))
    assert model.config.target_layer_ids == [1, 3] and model.config.block_size == 4


def test_resume_with_another_worker_count_matches_uninterrupted_run(tmp_path, tiny_cache,
                                                                    tiny_target_dir):
    """Run A: 6 steps on 2 workers with a checkpoint every 3 steps. Run B: resume A's step-3
    checkpoint on 1 worker. Steps 4-6 must see the same data, optimizer and LR state, so their
    losses equal A's (up to gloo's float reduction order)."""
    _, log_a = _train(tiny_cache, tiny_target_dir, tmp_path / "a", num_epochs=3,
                      checkpoint_every=3)
    ckpts = {json.loads(p.read_text())["step"]: p.parent
             for p in (tmp_path / "a" / "ray_train").rglob("train_state.json")}
    assert sorted(ckpts) == [3, 6]
    for ckpt in ckpts.values():  # marked complete, the marker listing both ranks' files
        assert inspect_checkpoint(str(ckpt)).complete
        marker = json.loads((ckpt / MARKER).read_text())
        assert marker["world_size"] == 2 and any("zero_pp_rank_1" in n for n in marker["ranks"][1])
    # (on 2 workers the same restore runs with one change fewer: no resharding of ZeRO state)
    result, log_b = _train(tiny_cache, tiny_target_dir, tmp_path / "b", num_epochs=3,
                           num_workers=1, resume_from=str(ckpts[3]))
    assert result["resumed_from"] == str(ckpts[3])
    assert [h["step"] for h in log_b] == [1, 2, 3, 4, 5, 6]  # the log continues A's
    assert log_b[:3] == log_a[:3]
    for a, b in zip(log_a[3:], log_b[3:]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-6)
    # a fresh start from the same weights (init_from) is a different run: LR schedule restarts
    _, log_c = _train(tiny_cache, tiny_target_dir, tmp_path / "c", num_epochs=1,
                      init_from=str(tmp_path / "a" / "drafter"))
    assert log_c[0]["step"] == 1 and log_c[0]["loss"] < log_a[0]["loss"]


def test_a_damaged_shard_is_named_before_training_starts(tmp_path, tiny_cache, tiny_target_dir):
    """Bytes flipped in one shard after the cache stage: the manifest's sha256 catches it at
    training start, naming the file; nothing is trained or written."""
    import shutil

    from pipeline.cache.format import CorruptShardError

    cache_dir, manifest = tiny_cache
    damaged = tmp_path / "cache"
    shutil.copytree(cache_dir, damaged)
    shard = manifest["splits"]["train"]["shards"][0]["file"]
    path = damaged / "train" / shard
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    tc = TrainConfig(num_workers=1, num_threads=1, micro_batch_size=2, global_batch_size=2)
    dc = DrafterConfig(num_layers=1, block_size=4, markov_rank=16)
    with pytest.raises(CorruptShardError, match=shard):
        run_train(cache_dir=str(damaged), manifest=manifest, out_dir=tmp_path / "train",
                  target=str(tiny_target_dir), layer_ids=[1, 3], drafter=dc, train=tc,
                  wandb_cfg=WANDB, storage_options={}, run_name="t")
    assert not (tmp_path / "train" / "drafter").exists()


def _poison_row(cache_dir, manifest, row: int, dest):
    """A copy of the cache whose global train row ``row`` has NaN context features, with the
    manifest's hash updated so only the NaN (not the hash check) can stop training."""
    import copy
    import hashlib
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.cache.format import SCHEMA
    from pipeline.train.data import CacheRowIndex

    shutil.copytree(cache_dir, dest)
    index = CacheRowIndex(str(dest), manifest, "train", {})
    g, i = index.locate(row)
    ref = index.groups[g]
    in_shard = sum(r.rows for r in index.groups[:g] if r.path == ref.path) + i
    table = pq.read_table(ref.path)
    rows = table.to_pylist()
    nan_bf16 = b"\xc0\x7f"  # little-endian 0x7FC0
    rows[in_shard]["context_hidden"] = nan_bf16 * (len(rows[in_shard]["context_hidden"]) // 2)
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), ref.path, row_group_size=2)
    poisoned = copy.deepcopy(manifest)
    name = ref.path.rsplit("/", 1)[1]
    for shard in poisoned["splits"]["train"]["shards"]:
        if shard["file"] == name:
            shard["sha256"] = hashlib.sha256(open(ref.path, "rb").read()).hexdigest()
    return str(dest), poisoned


def _row_in_step(tiny_cache, step_in_epoch: int) -> int:
    """A train row that rank 0 reads first in global step ``step_in_epoch`` of epoch 0."""
    from pipeline.train.data import CacheRowIndex

    cache_dir, manifest = tiny_cache
    order = CacheRowIndex(cache_dir, manifest, "train", {}).epoch_order(0, 0)
    return int(order[4 * step_in_epoch])  # global batch 4


def test_a_nan_feature_row_skips_the_step_and_training_finishes(tmp_path, tiny_cache,
                                                                tiny_target_dir):
    """One NaN row in the cache: the steps that read it are skipped and counted on both workers,
    the other steps train, and the drafter stays finite."""
    import torch

    poisoned = _poison_row(*tiny_cache, _row_in_step(tiny_cache, 1), tmp_path / "cache")
    _, log = _train(poisoned, tiny_target_dir, tmp_path / "train", num_epochs=2,
                    max_bad_steps=2)
    assert [h["step"] for h in log] == [1, 2, 3, 4]
    assert log[-1]["skipped_steps"] == 2  # the NaN row is read once per epoch
    assert log[1]["skipped_steps"] == 1 and log[0]["skipped_steps"] == 0
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in log)
    target = load_target(str(tiny_target_dir))
    model = load_drafter(tmp_path / "train" / "drafter", target, str(tiny_target_dir))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_too_many_bad_steps_abort_and_keep_the_checkpoint_before(tmp_path, tiny_cache,
                                                                 tiny_target_dir):
    """max_bad_steps 0: the first non-finite step aborts the run with a message; the checkpoint
    of the step before is intact and resumable, and no final drafter is written."""
    poisoned = _poison_row(*tiny_cache, _row_in_step(tiny_cache, 1), tmp_path / "cache")
    with pytest.raises(RuntimeError, match="non-finite loss"):
        _train(poisoned, tiny_target_dir, tmp_path / "train", num_epochs=2, max_bad_steps=0,
               checkpoint_every=1)
    states = [json.loads(p.read_text()) for p in
              (tmp_path / "train" / "ray_train").rglob("train_state.json")]
    assert [s["step"] for s in states] == [1]
    assert not (tmp_path / "train" / "drafter").exists()
    result, log = _train(tiny_cache, tiny_target_dir, tmp_path / "train", num_epochs=2,
                         resume_from="latest")
    assert result["resumed_from"] and [h["step"] for h in log] == [1, 2, 3, 4]


def _kill_a_train_worker_after(checkpoint_root, step: int, killed: list, timeout_s: float = 300):
    """Background: once the checkpoint of ``step`` exists under ``checkpoint_root``, SIGKILL one
    Ray Train worker process (a preempted or crashed worker) of this test session's own Ray (a
    descendant of this process: other Ray jobs on the machine are left alone); records its pid in
    ``killed``."""
    import os
    import signal
    import time

    import psutil

    def step_of(path) -> int | None:
        try:  # rank 0 may be writing it right now: an empty or partial file is not yet a step
            return json.loads(path.read_text())["step"]
        except (OSError, ValueError, KeyError):
            return None

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if any(step_of(p) == step for p in checkpoint_root.rglob("train_state.json")):
            for proc in psutil.Process().children(recursive=True):
                try:
                    cmd = " ".join(proc.cmdline())
                except psutil.Error:
                    continue
                if cmd.startswith("ray::RayTrainWorker"):
                    os.kill(proc.pid, signal.SIGKILL)
                    killed.append(proc.pid)
                    return
        time.sleep(0.05)


def test_a_killed_worker_restarts_from_the_checkpoint_and_ends_as_uninterrupted(
        tmp_path, tiny_cache, tiny_target_dir, uninterrupted):
    """kill -9 of one training worker mid-run: with max_failures 1 Ray Train restarts the worker
    group from the newest checkpoint and the final weights equal the uninterrupted run's (same
    seed and schedule; gloo's float reduction order is the only difference)."""
    import threading

    import torch

    ref_dir, _, _ = uninterrupted
    killed: list = []
    watcher = threading.Thread(target=_kill_a_train_worker_after,
                               args=(tmp_path / "run" / "ray_train", 8, killed), daemon=True)
    watcher.start()
    result, log = _train(tiny_cache, tiny_target_dir, tmp_path / "run", **UNINTERRUPTED)
    watcher.join()
    assert killed, "no training worker was found to kill"
    # max_failures 0 would have failed the run: finishing means the group restarted
    assert result["steps"] == 24 and [h["step"] for h in log] == list(range(1, 25))
    # it continued from a complete checkpoint (pipeline.checkpoints.restore_choice takes the newest
    # with its marker written; the kill waits for step 8's state, so step 4's marker is there),
    # not from step 0
    resumed = [h["step"] for h in log if h["resumes"] >= 1]
    assert resumed and resumed[0] - 1 in (4, 8, 12, 16, 20), resumed
    target = load_target(str(tiny_target_dir))
    ref = load_drafter(ref_dir / "drafter", target, str(tiny_target_dir))
    run = load_drafter(tmp_path / "run" / "drafter", target, str(tiny_target_dir))
    for (name, a), b in zip(ref.state_dict().items(), run.state_dict().values()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), name
