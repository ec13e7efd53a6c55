"""Checkpoint completeness (pipeline/checkpoints.py): ``train.resume_from: latest`` never picks a
checkpoint that some rank did not finish writing, says which one it skipped and why, and a
checkpoint named explicitly fails naming its directory.

The fake checkpoints have the layout the writer produces (pipeline/train/state.py
``save_training_state``): each rank's files in its own directory, merged into the checkpoint
directory the way Ray Train's upload merges them, ``train_state.json`` from
``train_state_bytes``, and the marker from ``write_marker`` over each rank's ``local_files``.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from pipeline.checkpoints import (MARKER, STATE, IncompleteCheckpointError, checkpoint_url,
                                  inspect_checkpoint, latest_checkpoint, local_files,
                                  parse_train_state, require_complete, restore_choice,
                                  train_state_bytes, write_marker)

RUN = "run"


def _rank_dir(root: Path, rank: int, step: int, world: int, marker: bool,
              fit_id: str | None = None) -> Path:
    """One rank's temporary checkpoint directory, as DeepSpeed (ZeRO-1, tag "state") and
    save_training_state fill it."""
    d = root / f"rank{rank}"
    state = d / "deepspeed" / "state"
    state.mkdir(parents=True)
    (state / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"o" * (300 + rank))
    if rank == 0:
        (d / "deepspeed" / "latest").write_text("state")
        (state / "mp_rank_00_model_states.pt").write_bytes(b"m" * 200)
        (d / "deepspeed" / "zero_to_fp32.py").write_text("# recovery script\n")
        (d / "drafter").mkdir()
        (d / "drafter" / "config.json").write_text("{}")
        (d / "drafter" / "model.safetensors").write_bytes(b"w" * 100)
        (d / "drafter" / "training_log.jsonl").write_text(json.dumps({"step": step}) + "\n")
        (d / STATE).write_bytes(train_state_bytes(step, world, fit_id) if marker else
                                json.dumps({"step": step, "world_size": world}).encode())
    return d


def _checkpoint(storage: Path, name: str, step: int, world: int = 2,
                marker: bool = True, fit_id: str | None = None) -> Path:
    """A checkpoint written by ``world`` ranks: uploaded (merged), then marked complete;
    ``marker=False`` writes the layout of a checkpoint from before completion markers."""
    staging = storage.parent / f"staging-{name}"
    ranks = [_rank_dir(staging, r, step, world, marker, fit_id) for r in range(world)]
    dest = storage / RUN / name
    for d in ranks:
        shutil.copytree(d, dest, dirs_exist_ok=True)
    if marker:
        write_marker(str(dest), step, [local_files(d) for d in ranks])
    shutil.rmtree(staging)
    return dest


@pytest.fixture
def store(tmp_path) -> Path:
    root = tmp_path / "ray_train"
    (root / RUN).mkdir(parents=True)
    # Ray Train's own state file sits beside the checkpoints and starts with the same prefix
    (root / RUN / "checkpoint_manager_snapshot.json").write_text("{}")
    return root


PARTITION_1 = "deepspeed/state/zero_pp_rank_1_mp_rank_00_optim_states.pt"


def _rank1_partition_missing(ckpt: Path) -> None:
    (ckpt / PARTITION_1).unlink()


def _deepspeed_state_missing(ckpt: Path) -> None:
    shutil.rmtree(ckpt / "deepspeed")


def _train_state_cut_off(ckpt: Path) -> None:
    data = (ckpt / STATE).read_bytes()
    (ckpt / STATE).write_bytes(data[:len(data) // 2])


def _marker_never_written(ckpt: Path) -> None:
    (ckpt / MARKER).unlink()


def _partition_cut_short(ckpt: Path) -> None:
    path = ckpt / PARTITION_1
    path.write_bytes(path.read_bytes()[:100])


DAMAGE = {
    "rank 1's optimizer partition missing": (_rank1_partition_missing,
                                             f"rank 1's {PARTITION_1} is missing"),
    "DeepSpeed state missing": (_deepspeed_state_missing, "rank 0's deepspeed/"),
    "train_state.json cut off mid-upload": (_train_state_cut_off, "is not valid JSON"),
    "a rank never finished (no marker)": (_marker_never_written,
                                          "some rank did not finish writing"),
    "a partition cut short": (_partition_cut_short, "has 100 bytes, 301 were written"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_latest_skips_an_incomplete_newest_checkpoint_and_says_why(store, damage, caplog):
    older = _checkpoint(store, "checkpoint_2026-12-01_10-00-00.000000", step=4)
    newer = _checkpoint(store, "checkpoint_2026-12-01_10-05-00.000000", step=6)
    assert latest_checkpoint(str(store), RUN) == str(newer)
    damage_fn, reason = DAMAGE[damage]
    damage_fn(newer)
    with caplog.at_level(logging.WARNING, logger="pipeline.checkpoints"):
        assert latest_checkpoint(str(store), RUN) == str(older)
    [skipped] = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert str(newer) in skipped and reason in skipped, skipped
    status = inspect_checkpoint(str(newer))
    assert not status.complete and reason in status.problem


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_an_incomplete_checkpoint_named_explicitly_fails_naming_it(store, damage):
    ckpt = _checkpoint(store, "checkpoint_a", step=2)
    assert require_complete(str(ckpt)) == 2
    DAMAGE[damage][0](ckpt)
    with pytest.raises(IncompleteCheckpointError, match=DAMAGE[damage][1]) as err:
        require_complete(str(ckpt))
    assert f"train.resume_from {ckpt} is not a complete training checkpoint" in str(err.value)
    with pytest.raises(IncompleteCheckpointError, match="no such checkpoint directory"):
        require_complete(str(store / RUN / "checkpoint_never_written"))


def test_none_complete_means_no_latest(store, caplog):
    ckpt = _checkpoint(store, "checkpoint_a", step=2)
    _train_state_cut_off(ckpt)
    with caplog.at_level(logging.WARNING, logger="pipeline.checkpoints"):
        assert latest_checkpoint(str(store), RUN) is None
    assert "step unknown" in caplog.text and "not valid JSON" in caplog.text
    assert latest_checkpoint(str(store), "no_such_run") is None


def test_highest_complete_step_wins_and_a_tie_goes_to_the_later_write(store):
    first = _checkpoint(store, "checkpoint_1", step=8)
    _checkpoint(store, "checkpoint_2", step=4)  # written later (a resume from an earlier step)
    assert latest_checkpoint(str(store), RUN) == str(first)
    again = _checkpoint(store, "checkpoint_3", step=8)  # a finished run reporting its state again
    assert latest_checkpoint(str(store), RUN) == str(again)


def test_checkpoints_from_before_markers_are_checked_by_their_layout(store, caplog):
    older = _checkpoint(store, "checkpoint_1", step=2, marker=False)
    newer = _checkpoint(store, "checkpoint_2", step=4, marker=False)
    assert inspect_checkpoint(str(newer)).complete
    assert latest_checkpoint(str(store), RUN) == str(newer)
    for damage, reason in ((_rank1_partition_missing, "rank 1's ZeRO optimizer partition"),
                           (_deepspeed_state_missing, "deepspeed/latest is missing"),
                           (_train_state_cut_off, "is not valid JSON")):
        broken = _checkpoint(store, "checkpoint_3", step=6, marker=False)
        damage(broken)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pipeline.checkpoints"):
            assert latest_checkpoint(str(store), RUN) == str(newer)
        assert str(broken) in caplog.text and reason in caplog.text, caplog.text
        shutil.rmtree(broken)
    assert older.exists()


def test_the_marker_lists_every_rank_file_with_its_size(store):
    ckpt = _checkpoint(store, "checkpoint_a", step=3, world=3)
    marker = json.loads((ckpt / MARKER).read_text())
    assert marker["step"] == 3 and marker["world_size"] == 3
    assert [sorted(n for n in r if "zero_pp_rank" in n) for r in marker["ranks"]] == [
        [f"deepspeed/state/zero_pp_rank_{r}_mp_rank_00_optim_states.pt"] for r in range(3)]
    assert STATE in marker["ranks"][0] and STATE not in marker["ranks"][1]
    on_disk = local_files(ckpt)
    assert all(on_disk[n] == size for r in marker["ranks"] for n, size in r.items())
    assert not list(ckpt.glob(".*tmp*"))  # written atomically


def test_a_restarted_group_continues_from_its_fits_newest_complete_checkpoint(store, caplog):
    """The choice is this run_train call's newest complete checkpoint, else the driver's; what
    Ray Train hands is only compared (it may be incomplete, missing, or override an explicit
    resume_from on a re-run)."""
    older = _checkpoint(store, "checkpoint_1", step=2, fit_id="fit")
    newer = _checkpoint(store, "checkpoint_2", step=4, fit_id="fit")
    explicit = str(store / "other_run_checkpoint")
    # no checkpoint of this fit yet: the driver's choice, whatever Ray hands
    assert restore_choice(None, explicit, str(store), RUN, fit_id="new") == explicit
    with caplog.at_level(logging.WARNING, logger="pipeline.checkpoints"):
        assert restore_choice(str(newer), explicit, str(store), RUN, fit_id="new") == explicit
    assert f"Ray Train restored {newer}" in caplog.text
    assert restore_choice(str(newer), None, str(store), RUN, fit_id="new") is None
    # this fit's newest complete one; an incomplete one is passed over
    assert restore_choice(None, None, str(store), RUN, fit_id="fit") == str(newer)
    _marker_never_written(newer)
    assert restore_choice(str(newer), None, str(store), RUN, fit_id="fit") == str(older)
    _marker_never_written(older)
    assert restore_choice(str(newer), explicit, str(store), RUN, fit_id="fit") == explicit


@pytest.mark.parametrize("ray_hands", [None, "checkpoint_3"])
@pytest.mark.parametrize("resume", [None, "checkpoint_1"])
@pytest.mark.parametrize("own", [False, True])
def test_the_feature_stream_and_the_workers_choose_the_same_checkpoint(store, ray_hands, resume,
                                                                      own):
    """pipeline.feature_stream.Checkpoints (the stream's factory) and restore_choice (the
    workers) agree in every case: otherwise samples between the two are lost or repeated."""
    from pipeline.feature_stream import Checkpoints

    _checkpoint(store, "checkpoint_1", step=2, fit_id="earlier")
    _checkpoint(store, "checkpoint_3", step=6, fit_id="earlier")
    if own:
        _checkpoint(store, "checkpoint_2", step=4, fit_id="this")
    path = lambda name: None if name is None else str(store / RUN / name)  # noqa: E731
    workers = restore_choice(path(ray_hands), path(resume), str(store), RUN, fit_id="this")
    stream = Checkpoints(str(store), RUN, {}, path(resume), "this").current()
    assert stream == workers == (path("checkpoint_2") if own else path(resume))


def test_a_restart_within_one_fit_continues_from_its_own_newest_checkpoint(store):
    """A worker killed right after a checkpoint's marker: Ray Train may not have registered it
    and hands nothing; the restarted group still continues from it, because this run_train
    call wrote it (its fit id), not from the driver's choice or step 0."""
    earlier = _checkpoint(store, "checkpoint_1", step=6, fit_id="earlier-call")
    mine = _checkpoint(store, "checkpoint_2", step=2, fit_id="this-call")
    assert restore_choice(None, None, str(store), RUN, fit_id="this-call") == str(mine)
    assert restore_choice(None, str(earlier), str(store), RUN, fit_id="this-call") == str(mine)
    # a new call (no checkpoint of its own yet) starts from the driver's choice
    assert restore_choice(None, str(earlier), str(store), RUN, fit_id="new") == str(earlier)
    assert inspect_checkpoint(str(mine)).fit_id == "this-call"


def test_train_state_errors_name_the_file():
    where = "/ckpt/checkpoint_x/train_state.json"
    assert parse_train_state(train_state_bytes(5, 2), where)["step"] == 5
    with pytest.raises(IncompleteCheckpointError, match=f"{where} is not valid JSON"):
        parse_train_state(b'{"step": 5, "wor', where)
    with pytest.raises(IncompleteCheckpointError, match=f"{where} lacks integer step"):
        parse_train_state(b'{"step": "5"}', where)


def test_checkpoint_url_gives_s3_paths_their_scheme():
    assert checkpoint_url("bucket/ckpt/run/checkpoint_1", "s3://bucket/ckpt") == \
        "s3://bucket/ckpt/run/checkpoint_1"
    assert checkpoint_url("/tmp/ray_train/run/checkpoint_1", "/tmp/ray_train") == \
        "/tmp/ray_train/run/checkpoint_1"


class _FakeEngine:
    """What save_training_state uses of a DeepSpeed engine, writing DeepSpeed's file names."""

    class module:  # noqa: N801  (engine.module.save_pretrained)
        @staticmethod
        def save_pretrained(path):
            Path(path).mkdir(parents=True)
            (Path(path) / "config.json").write_text("{}")
            (Path(path) / "model.safetensors").write_bytes(b"w" * 64)

    @staticmethod
    def save_checkpoint(path, tag):
        state = Path(path) / tag
        state.mkdir(parents=True)
        (Path(path) / "latest").write_text(tag)
        (state / "mp_rank_00_model_states.pt").write_bytes(b"m" * 32)
        (state / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"o" * 48)


def test_the_worker_side_writes_the_marker_last_and_resumes_the_newest_complete(
        store, monkeypatch):
    """save_training_state and resume_checkpoint (pipeline/train/state.py) with Ray Train's calls
    stood in for (one worker, a gloo group of one): the checkpoint is uploaded by report, then
    marked complete at the path Ray persisted it to; a restarted group continues from the newest
    complete checkpoint of its run_train call (its fit id), passing over an unmarked one."""
    import ray.train
    import torch.distributed as dist

    from pipeline.train.state import resume_checkpoint, save_training_state

    persisted, uploads = [], []

    class Context:
        get_world_rank = staticmethod(lambda: 0)
        get_world_size = staticmethod(lambda: 1)

    def report(metrics, checkpoint):  # Ray Train's upload: into <storage>/<run>/checkpoint_*
        assert not (Path(checkpoint.path) / MARKER).exists()  # the marker comes after
        dest = store / RUN / f"checkpoint_{len(uploads):02d}"
        shutil.copytree(checkpoint.path, dest)
        uploads.append(metrics)
        persisted.append(ray.train.Checkpoint(str(dest)))

    monkeypatch.setattr(ray.train, "get_context", lambda: Context)
    monkeypatch.setattr(ray.train, "report", report)
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: persisted[-1] if persisted else None)
    from pipeline.train.job import CheckpointPlace

    loop_cfg = CheckpointPlace(str(store), {}, RUN, fit_id="fit-1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert resume_checkpoint(loop_cfg) is None  # nothing yet: step 0
        for step in (2, 4):
            save_training_state(_FakeEngine, step, 1, [{"step": step}], {"step": step}, loop_cfg)
        first, second = (str(store / RUN / f"checkpoint_{i:02d}") for i in range(2))
        marker = json.loads((Path(second) / MARKER).read_text())
        assert marker["step"] == 4
        assert set(marker["ranks"][0]) == set(local_files(second)) - {MARKER}
        assert json.loads((Path(second) / STATE).read_text())["completion_marker"] == MARKER
        assert latest_checkpoint(str(store), RUN) == second
        assert resume_checkpoint(loop_cfg).path == second  # this fit's newest: complete
        (Path(second) / MARKER).unlink()  # as if the marker's write had been cut off
        assert resume_checkpoint(loop_cfg).path == first
    finally:
        dist.destroy_process_group()
