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


@pytest.mark.parametrize("kw, match", [
    ({"draft_vocab": (5, 2)}, "2 ids, drafter.draft_vocab_size is 3"),
    ({"draft_vocab": None}, "0 ids"),
    ({"steps_per_epoch": 0}, "steps_per_epoch 0"),
    ({"stop_step": 11}, "stop_step 11 is outside"),
])
def test_an_inconsistent_job_is_refused_before_any_worker_starts(kw, match):
    with pytest.raises(ValueError, match=match):
        _job(**kw)
