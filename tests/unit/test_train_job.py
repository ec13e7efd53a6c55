"""The frozen job the train driver hands every worker (pipeline/train/job.py): built once, checked
at construction, and the one place the draft vocabulary travels."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from drafters.config import DrafterConfig
from pipeline.config import TrainConfig
from pipeline.train.job import CheckpointPlace, TrainJob


def _job(**kw):
    base = dict(train=TrainConfig(), drafter=DrafterConfig(draft_vocab_size=3), target="t",
                layer_ids=(1, 3), target_hidden_size=64, total_steps=10, steps_per_epoch=4,
                manifest={"splits": {}}, cache_dir="/c", checkpoints=CheckpointPlace("/s", {}, "r"),
                wandb={"mode": "disabled"}, wandb_dir="/w", wandb_run_id="id",
                torch_extensions_dir="/x", draft_vocab=(5, 2, 9))
    return TrainJob(**{**base, **kw})


def test_a_job_is_frozen_pickles_and_says_its_context_width():
    job = _job()
    assert job.num_context_layers == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.total_steps = 11
    back = pickle.loads(pickle.dumps(job))  # what Ray does on the way to each worker
    assert back == job and back.drafter.draft_vocab_size == 3
    assert job.end_step == 10 and _job(stop_step=4).end_step == 4
    # hybrid's first epoch longer than a short run (train.max_steps): the run's end is the total
    assert _job(stop_step=11).end_step == 10


@pytest.mark.parametrize("kw, match", [
    ({"draft_vocab": (5, 2)}, "2 ids, drafter.draft_vocab_size is 3"),
    ({"draft_vocab": None}, "0 ids"),
    ({"steps_per_epoch": 0}, "steps_per_epoch 0"),
    ({"stop_step": 0}, "stop_step 0 must be >= 1"),
])
def test_an_inconsistent_job_is_refused_before_any_worker_starts(kw, match):
    with pytest.raises(ValueError, match=match):
        _job(**kw)


def test_a_failed_worker_closes_everything_marks_its_run_failed_and_keeps_its_own_error():
    from pipeline.train.loop import WorkerLoop

    calls = []

    class Part:
        def __init__(self, name, broken=False):
            self.name, self.broken = name, broken

        def close(self):
            calls.append(self.name)
            if self.broken:
                raise OSError("reader already gone")

    class Run:
        def finish(self, exit_code=0):
            calls.append(f"finish {exit_code}")

    loop = WorkerLoop.__new__(WorkerLoop)  # the parts set-up made, without Ray
    loop.stream, loop.data, loop.bar, loop.run_log = (Part("stream", broken=True), Part("data"),
                                                      Part("bar"), Run())
    loop.close(failed=True)  # a broken part does not hide the run's error
    assert calls == ["stream", "data", "bar", "finish 1"]
    calls.clear()
    loop.stream = Part("stream")
    loop.close()
    assert calls == ["stream", "data", "bar", "finish 0"]
