"""Online and hybrid training refuse, up front and naming the fields, a config whose trainers and
target actors cannot run together on the cluster (Ray Data would wait for the actors forever)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline.config import CacheConfig, TrainConfig
from pipeline.train.modes import check_resources


def _ctx(**cache):
    cfg = SimpleNamespace(train=TrainConfig(num_workers=2, cpus_per_worker=1,
                                            global_batch_size=8, micro_batch_size=4,
                                            data_mode="online"),
                          cache=CacheConfig(**cache))
    return SimpleNamespace(cfg=cfg)


def test_trainers_and_target_actors_must_fit_the_cluster(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0})
    check_resources(_ctx(num_actors=1, cpus_per_actor=1))  # 2 + 1 + 1 = 4: fits
    with pytest.raises(ValueError, match=r"cache.num_actors x cache.cpus_per_actor \+ 1 = 5 "
                                         r"CPUs and 0 GPUs, the Ray cluster has 4 CPUs"):
        check_resources(_ctx(num_actors=2, cpus_per_actor=1))
    with pytest.raises(ValueError, match="1 GPUs, the Ray cluster has 4 CPUs and 0 GPUs"):
        check_resources(_ctx(num_actors=1, cpus_per_actor=1, gpus_per_actor=1))
