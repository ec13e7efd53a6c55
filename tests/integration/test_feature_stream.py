"""Online features are the cache's features (issue 23, "same data, same model"): a streamed row
is byte for byte the cached row of the same sample, so the drafter's loss on a fixed batch is the
same from either; one epoch of the online stream holds every sample of the split exactly once; a
stream rebuilt from a checkpoint's record leaves out exactly the samples trained on."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from drafters.config import DrafterConfig
from drafters.loading import build_drafter
from drafters.target_weights import load_frozen_head
from pipeline.cache.stage import CacheTarget, CacheWriterUDF
from pipeline.config import CacheConfig, TrainConfig
from pipeline.cache.format import shard_key
from pipeline.feature_stream import Checkpoints, FeatureStreamUDF, TrainStream, scan_split
from pipeline.stream_state import StreamState
from pipeline.train.data import ArrowRowGroup, row_generator
from pipeline.train.worker import batch_losses

from .conftest import conversations

CACHE = CacheConfig(max_length=256, min_supervised_tokens=5, rows_per_shard=4,
                    rows_per_row_group=2, num_threads=1)


def _multi_turn(i: int) -> dict:
    conv = conversations(i + 1)[i]
    conv["id"] = f"m{i:02d}"
    conv["messages"] += [{"role": "user", "content": "And doubled?"},
                         {"role": "assistant", "content": f"Doubled it is {4 * i + 2}, since "
                                                          f"2 x {2 * i + 1} = {4 * i + 2}."}]
    return conv


def _convs() -> list[dict]:
    bad = {"id": "z-bad", "domain": "chat", "messages": [{"role": "user", "content": "hi"},
                                                         {"role": "assistant", "content": "ok"}]}
    return conversations(6) + [_multi_turn(1), bad]


def _target(tiny_target_dir) -> CacheTarget:
    return CacheTarget(str(tiny_target_dir), "float32", [1, 3], {})


def _jsonl(convs) -> bytes:
    return "".join(json.dumps(c) + "\n" for c in convs).encode()


def test_streamed_rows_are_the_cached_rows_and_give_the_same_loss(tmp_path, tiny_target_dir):
    convs = sorted(conversations(5), key=lambda c: shard_key(c["id"]))  # the cache's order
    writer = CacheWriterUDF(_target(tiny_target_dir), CACHE, {})
    writer.write_shard(str(tmp_path / "shard-00000"), convs, "fp")
    cached = pq.read_table(tmp_path / "shard-00000.parquet")
    stream = FeatureStreamUDF(_target(tiny_target_dir), CACHE, _jsonl(convs[::-1]))
    tables = list(stream({"epoch": np.zeros(5, dtype=np.int64), "conversation": np.arange(5)}))
    assert [t.num_rows for t in tables] == [2, 2, 1]  # cut as the writer cuts row groups
    streamed = pa.concat_tables(tables)
    for name in cached.column_names:
        assert streamed.column(name).to_pylist() == cached.column(name).to_pylist(), name
    assert streamed.column("epoch").to_pylist() == [0] * 5
    assert streamed.column("conversation").to_pylist() == list(range(5))
    # samples already trained on are left out
    consumed = FeatureStreamUDF(_target(tiny_target_dir), CACHE, _jsonl(convs),
                                consumed={0: {convs[1]["id"]}})
    left = pa.concat_tables(list(consumed({"epoch": np.zeros(5, dtype=np.int64),
                                           "conversation": np.arange(5)})))
    assert left.column("sample_id").to_pylist() == [c["id"] for c in convs if c is not convs[1]]

    # the drafter's loss on one batch, from either source, with the same anchors
    target_cfg, emb, head, *_ = load_frozen_head(str(tiny_target_dir), 0)
    dcfg = DrafterConfig(num_layers=1, block_size=4, markov_rank=16).for_target(
        target_cfg, str(tiny_target_dir), [1, 3])
    torch.manual_seed(0)
    model = build_drafter(dcfg, emb, head, None)
    tc = TrainConfig(num_workers=1, micro_batch_size=5, global_batch_size=5, num_anchors=8)
    objective, weights = dcfg.spec.training_objective(dcfg)
    losses = []
    for table in (cached, streamed):
        group = ArrowRowGroup(table)
        samples = [group.decode(i, 64, 2) for i in range(5)]
        gens = [row_generator(0, 0, s) for s in group.sample_ids]
        losses.append(batch_losses(model, samples, tc, objective, weights, torch.device("cpu"),
                                   gens)["loss"].item())
    assert losses[0] == losses[1] and np.isfinite(losses[0])


def test_one_epoch_of_the_online_stream_holds_every_sample_once(tmp_path, tiny_target_dir,
                                                                ray_local):
    path = tmp_path / "train.jsonl"
    path.write_bytes(_jsonl(_convs()))
    scan = scan_split(str(path), _target(tiny_target_dir), CACHE)
    # the bad conversation makes no sample, the two-turn one makes one per assistant turn when the
    # template renders history differently, else one
    assert scan.ids == sorted((c["id"] for c in _convs()), key=shard_key)  # cache order
    assert [e["id"] for e in scan.errors] == ["z-bad"]
    assert scan.rows == int(scan.samples_per_conversation.sum()) >= 7
    per_epoch = scan.rows // 2
    stream = TrainStream(ray_local.put(path.read_bytes()), scan, _target(tiny_target_dir), CACHE,
                         seed=3, total_steps=per_epoch, global_batch_size=2,
                         checkpoints=Checkpoints(str(tmp_path / "ckpt"), "t", {}, None))
    rows = stream().select_columns(["sample_id", "epoch", "conversation"]).take_all()
    first = [r for r in rows if r["epoch"] == 0]
    assert sorted(r["sample_id"] for r in first) == sorted(
        r["sample_id"] for r in rows if r["epoch"] == 1)  # the next epoch: the same samples
    assert len(first) == scan.rows and len({r["sample_id"] for r in first}) == scan.rows
    assert {r["epoch"] for r in rows} == {0, 1}  # the schedule plus one spare epoch

    # rebuilt from a record: epoch 0 partly trained on (one of the two-turn conversation's
    # samples among them), epoch 1 begun: each epoch holds exactly the samples left
    ids = sorted(r["sample_id"] for r in first)
    two_turn = [i for i in ids if i.startswith("m01")]
    state = StreamState(scan.rows)
    state.add(0, [i for i in ids if not i.startswith("m01")][:3] + two_turn[:1])
    state.add(1, ids[-2:])
    resumed = stream.dataset(state).select_columns(["sample_id", "epoch"]).take_all()
    for epoch in (0, 1):
        got = sorted(r["sample_id"] for r in resumed if r["epoch"] == epoch)
        assert got == sorted(set(ids) - state.consumed[epoch]), epoch
    # a complete epoch 0 makes the stream start at epoch 1
    state.add(0, ids)
    assert {r["epoch"] for r in stream.dataset(state).select_columns(["epoch"]).take_all()} \
        == {1}
