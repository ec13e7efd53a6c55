"""Ray Train + DeepSpeed (ZeRO-1, gloo) with 2 workers on the tiny target: the loss goes down and
the final checkpoint is a loadable HF drafter directory."""

from __future__ import annotations

import json

import pytest

from drafters.modeling import DSparkDrafter
from pipeline import storage
from pipeline.cache import build_manifest, run_cache_split
from pipeline.target import load_target
from pipeline.train import run_train

from .conftest import conversations

pytestmark = pytest.mark.slow


def test_two_workers_loss_goes_down(tmp_path, tiny_target_dir, ray_local):
    convs = conversations(8)
    cache_dir = str(tmp_path / "cache")
    shards = run_cache_split(
        convs, storage.join(cache_dir, "train"), target=str(tiny_target_dir), dtype="float32",
        layer_ids=[1, 3], template_kwargs={}, max_length=256, min_supervised=5,
        rows_per_shard=4, rows_per_row_group=2, num_actors=1, cpus_per_actor=1,
        gpus_per_actor=0, num_threads=1, storage_options={})
    manifest = build_manifest(target=str(tiny_target_dir), revision=None, layer_ids=[1, 3],
                              hidden_size=64, vocab_size=49152, template_sha256="x",
                              template_kwargs={}, max_length=256, splits={"train": shards})
    train = {"num_workers": 2, "use_gpu": False, "cpus_per_worker": 1, "num_threads": 1,
             "micro_batch_size": 2, "global_batch_size": 4, "num_epochs": 12, "max_steps": None,
             "lr": 3e-3, "weight_decay": 0.0, "warmup_ratio": 0.1, "grad_clip": 1.0,
             "num_anchors": 16, "zero_stage": 1, "precision": "fp32",
             "loss_weights": (0.1, 0.9, 1.0), "log_every": 1, "seed": 0}
    drafter = {"drafter_type": "dspark", "num_layers": 1, "block_size": 4, "head_type": "markov",
               "markov_rank": 16, "confidence_head": True, "loss_decay": None}
    result = run_train(cache_dir=cache_dir, manifest=manifest, out_dir=tmp_path / "train",
                       target=str(tiny_target_dir), layer_ids=[1, 3], drafter=drafter, train=train,
                       wandb_cfg={"project": "t", "entity": None, "mode": "offline"},
                       storage_options={}, run_name="t")
    assert result["steps"] == 24  # 8 rows / 2 workers / micro-batch 2: 2 optimizer steps per epoch
    log = [json.loads(l) for l in (tmp_path / "train" / "drafter" / "training_log.jsonl").open()]
    assert [h["step"] for h in log] == list(range(1, result["steps"] + 1))
    first = sum(h["loss"] for h in log[:4]) / 4
    last = sum(h["loss"] for h in log[-4:]) / 4
    assert last < 0.8 * first, (first, last)
    assert log[-1]["tau"] > log[0]["tau"]
    # W&B ran offline inside the run directory
    assert list((tmp_path / "train" / "wandb").rglob("offline-run-*"))
    target = load_target(str(tiny_target_dir))
    model = DSparkDrafter.from_pretrained(tmp_path / "train" / "drafter",
                                          target.get_input_embeddings().weight,
                                          target.get_output_embeddings().weight)
    assert model.config.target_layer_ids == [1, 3] and model.config.block_size == 4
