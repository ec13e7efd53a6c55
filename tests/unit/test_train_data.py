"""The training reader (pipeline/train/data.py): prefetching never changes which rows a step sees
or their order, a resumed plan is the tail of the uninterrupted one, rows decode exactly as the
plain pylist path, and a bad row surfaces at its own micro-batch."""

from __future__ import annotations

import random
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.cache.format import CorruptShardError, SCHEMA, decode_row
from pipeline.train.data import (ArrowRowGroup, CacheRowIndex, CacheRowReader, worker_micro_batches,
                                 worker_plan)

H, M = 8, 2


def _row(i: int, t: int) -> dict:
    rng = np.random.default_rng(i)
    return {"sample_id": f"s{i:03d}", "domain": "math", "num_tokens": t,
            "input_ids": rng.integers(0, 1000, t, dtype="<i4").tobytes(),
            "loss_mask": rng.integers(0, 2, t, dtype=np.uint8).tobytes(),
            "context_hidden": rng.integers(-2**15, 2**15, t * M * H, dtype="<i2").tobytes(),
            "last_hidden": rng.integers(-2**15, 2**15, t * H, dtype="<i2").tobytes()}


def _cache(tmp_path, shard_rows=(6, 5, 7), group=2, bad: int | None = None) -> tuple[str, dict]:
    """A cache of random rows (row i has 3 + i % 5 tokens); row ``bad`` has a short column."""
    (tmp_path / "train").mkdir()
    shards, i = [], 0
    for n, rows in enumerate(shard_rows):
        records = []
        for _ in range(rows):
            r = _row(i, 3 + i % 5)
            if i == bad:
                r["last_hidden"] = r["last_hidden"][:-2]
            records.append(r)
            i += 1
        name = f"shard-{n:05d}.parquet"
        pq.write_table(pa.Table.from_pylist(records, schema=SCHEMA), tmp_path / "train" / name,
                       row_group_size=group)
        shards.append({"file": name, "rows": rows})
    return str(tmp_path), {"splits": {"train": {"shards": shards}}}


def _plain(index: CacheRowIndex, row: int) -> dict:
    """The reference decode: the row's group as Python values, then ``decode_row``."""
    g, i = index.locate(row)
    ref = index.groups[g]
    return decode_row(pq.ParquetFile(ref.path).read_row_group(ref.index).to_pylist()[i], H, M)


def _same(a: dict, b: dict) -> None:
    assert a["sample_id"] == b["sample_id"]
    for k in ("input_ids", "loss_mask", "context_hidden", "last_hidden"):
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.int16) if a[k].dtype == torch.bfloat16 else a[k],
                           b[k].view(torch.int16) if b[k].dtype == torch.bfloat16 else b[k]), k


def test_read_decodes_like_the_pylist_path(tmp_path):
    cache_dir, manifest = _cache(tmp_path)
    index = CacheRowIndex(cache_dir, manifest, "train", {})
    assert index.num_rows == 18 and len(index.groups) == 3 + 3 + 4
    rows = list(np.random.default_rng(0).permutation(index.num_rows))
    with CacheRowReader(index, H, M, io_threads=3) as reader:
        got = reader.read(rows)
    assert [s["row_id"] for s in got] == rows
    for row, sample in zip(rows, got):
        _same(sample, _plain(index, row))
        assert sample["context_hidden"].shape == (sample["input_ids"].numel(), M * H)
    # tensors are fresh and writable (nothing downstream can scribble on a cached row group)
    got[0]["context_hidden"].zero_()
    with CacheRowReader(index, H, M) as reader:
        _same(reader.read([rows[0]])[0], _plain(index, rows[0]))


@pytest.mark.parametrize("depth", [0, 1, 5])
def test_prefetch_hands_out_the_plan_in_order_even_when_reads_finish_out_of_order(tmp_path, depth):
    """Row-group reads sleep a random time, and only 2 row groups are cached (forcing evictions
    and re-reads): the stream still equals reading each micro-batch synchronously."""
    cache_dir, manifest = _cache(tmp_path)
    index = CacheRowIndex(cache_dir, manifest, "train", {})
    plan = list(worker_plan(index, seed=3, start_step=0, end_step=8, steps_per_epoch=4,
                            global_batch_size=4, micro_batch_size=2, rank=0, world_size=1))
    with CacheRowReader(index, H, M) as ref_reader:
        expected = [ref_reader.read(rows) for rows in plan]
    jitter = random.Random(0)
    reader = CacheRowReader(index, H, M, cached_groups=2, io_threads=4)
    load = reader._load_group
    reader._load_group = lambda g: (time.sleep(jitter.random() * 0.01), load(g))[1]
    with reader:
        streamed = list(reader.prefetch(iter(plan), depth=depth))
    assert [rows for rows, _ in streamed] == plan
    for (_, samples), want in zip(streamed, expected):
        assert [s["row_id"] for s in samples] == [s["row_id"] for s in want]
        for a, b in zip(samples, want):
            _same(a, b)


def test_an_epoch_reads_each_row_group_once(tmp_path):
    cache_dir, manifest = _cache(tmp_path, shard_rows=(16, 16, 16, 16))
    index = CacheRowIndex(cache_dir, manifest, "train", {})
    plan = worker_plan(index, 0, 0, 8, 8, 8, 2, 0, 1)  # one epoch: 64 rows / 8 per step
    with CacheRowReader(index, H, M) as reader:
        rows = [r for batch, _ in reader.prefetch(plan, depth=4) for r in batch]
        assert sorted(rows) == list(range(64))
        assert reader.groups_read == len(index.groups) == 32


def test_a_resumed_plan_is_the_tail_of_the_uninterrupted_one_for_any_worker_count(tmp_path):
    cache_dir, manifest = _cache(tmp_path)
    index = CacheRowIndex(cache_dir, manifest, "train", {})
    per_epoch = index.num_rows // 4  # global batch 4: 4 steps per epoch, 2 rows dropped

    def plan(start, world, rank):
        return list(worker_plan(index, 7, start, 10, per_epoch, 4, 1, rank, world))

    full = plan(0, 1, 0)
    assert len(full) == 40
    for start in (0, 3, 4, 9):  # mid-epoch, at an epoch boundary, near the end
        assert plan(start, 1, 0) == full[4 * start:]
        # two workers: step s of worker r is the r-th half of the same global batch
        halves = [plan(start, 2, r) for r in (0, 1)]
        for k in range(10 - start):
            assert halves[0][2 * k] + halves[0][2 * k + 1] + halves[1][2 * k] + \
                halves[1][2 * k + 1] == [r for b in full[4 * (start + k):4 * (start + k + 1)]
                                         for r in b]
    # epochs reshuffle, and the plan follows each epoch's order
    order1 = index.epoch_order(7, 1)
    assert full[4 * per_epoch:4 * per_epoch + 4] == worker_micro_batches(order1, 0, 4, 1, 0, 1)
    assert full[:4] != full[4 * per_epoch:4 * per_epoch + 4]


def test_a_bad_row_surfaces_at_its_own_micro_batch(tmp_path):
    cache_dir, manifest = _cache(tmp_path, bad=9)
    index = CacheRowIndex(cache_dir, manifest, "train", {})
    plan = [[0, 1], [2, 3], [9, 4], [5, 6]]
    with CacheRowReader(index, H, M) as reader:
        stream = reader.prefetch(plan, depth=3)
        assert [next(stream)[0] for _ in range(2)] == plan[:2]
        with pytest.raises(CorruptShardError, match="'s009'.*last_hidden"):
            next(stream)


def test_missing_shard_is_raised_by_the_index(tmp_path):
    cache_dir, manifest = _cache(tmp_path)
    (tmp_path / "train" / "shard-00001.parquet").unlink()
    with pytest.raises(FileNotFoundError):
        CacheRowIndex(cache_dir, manifest, "train", {})


@pytest.mark.parametrize("drift, named", [
    (lambda sch: sch.set(sch.get_field_index("context_hidden"),
                         pa.field("context_hidden", pa.large_binary())),
     "context_hidden is large_binary, expected binary"),
    (lambda sch: sch.remove(sch.get_field_index("loss_mask")), "loss_mask is missing"),
    (lambda sch: sch.set(sch.get_field_index("input_ids"),
                         pa.field("input_ids", pa.list_(pa.int32()))),
     "input_ids is list<.*int32>, expected binary"),
])
def test_a_shard_whose_schema_drifted_is_named_with_its_columns_by_the_index(tmp_path, drift,
                                                                             named):
    """Written by another tool (large_binary, a list column, a dropped column), the shard used
    to fail mid-training as 'column input_ids has 0 bytes', naming neither shard nor schema."""
    cache_dir, manifest = _cache(tmp_path)
    path = tmp_path / "train" / "shard-00001.parquet"
    table = pq.read_table(path)
    schema = drift(table.schema)
    columns = {}
    for f in schema:
        col = table.column(f.name)
        if pa.types.is_list(f.type):  # the bytes as int32 lists
            col = pa.array([list(np.frombuffer(v, dtype="<i4")) for v in col.to_pylist()], f.type)
        columns[f.name] = col.cast(f.type) if not pa.types.is_list(f.type) else col
    pq.write_table(pa.table(columns, schema=schema), path, row_group_size=2)
    with pytest.raises(CorruptShardError, match=f"shard-00001.parquet.*{named}.*--repair-cache"):
        CacheRowIndex(cache_dir, manifest, "train", {})


def test_arrow_row_group_handles_chunked_and_sliced_columns():
    """A binary column over 2 GiB comes back in several chunks; chunks may be slices."""
    rows = [_row(i, 2 + i) for i in range(5)]
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    pieces = {}
    for name in SCHEMA.names:
        full = pa.concat_arrays([table.column(name).combine_chunks(),
                                 table.column(name).combine_chunks()])
        # chunk 1: rows 0-1; chunk 2: a slice (offset 2) of the doubled array: rows 2-4
        pieces[name] = pa.chunked_array([full.slice(0, 2), full.slice(2, 3)])
    group = ArrowRowGroup(pa.table(pieces))
    assert [len(c[1]) for c in (group.columns["context_hidden"],)] == [2]
    for i, row in enumerate(rows):
        _same(group.decode(i, H, M), decode_row(row, H, M))


def test_subset_manifest_takes_whole_shards_nested_and_keeps_heldout():
    """train.max_train_rows: whole shards in a seeded order until enough rows; a smaller subset
    is inside every larger one; counts recomputed; held-out split untouched."""
    from pipeline.train.data import subset_manifest

    shards = [{"file": f"s{i}.parquet", "rows": 10, "tokens": 100 + i, "supervised_tokens": 50}
              for i in range(12)]
    manifest = {"splits": {"train": {"rows": 120, "tokens": sum(s["tokens"] for s in shards),
                                     "supervised_tokens": 600, "shards": shards,
                                     "token_frequency": [[5, 9]]},
                           "heldout": {"rows": 7, "shards": [{"file": "h.parquet", "rows": 7}]}}}
    small = subset_manifest(manifest, 25, seed=0)
    large = subset_manifest(manifest, 61, seed=0)
    files = lambda m: [s["file"] for s in m["splits"]["train"]["shards"]]  # noqa: E731
    assert small["splits"]["train"]["rows"] == 30 and large["splits"]["train"]["rows"] == 70
    assert set(files(small)) < set(files(large))
    assert files(large) == sorted(files(large), key=lambda f: int(f[1:-8]))  # original order
    assert small["splits"]["train"]["tokens"] == sum(
        s["tokens"] for s in small["splits"]["train"]["shards"])
    assert small["splits"]["train"]["token_frequency"] == [[5, 9]]
    assert small["splits"]["heldout"] == manifest["splits"]["heldout"]
    assert manifest["splits"]["train"]["rows"] == 120  # the input is not modified
    assert subset_manifest(manifest, None, 0) is manifest
    assert subset_manifest(manifest, 500, 0) is manifest
    assert files(subset_manifest(manifest, 25, seed=1)) != files(small)


def test_plateau_reached_after_patience_evaluations_without_progress():
    from pipeline.train.data import plateau_reached

    def log(*taus):
        out = []
        for i, t in enumerate(taus):
            out += [{"step": 2 * i + 1}, {"step": 2 * i + 2, "heldout_tau": t}]
        return out

    assert not plateau_reached(log(1.2, 1.4, 1.5), None, 0.01)
    assert not plateau_reached(log(1.2, 1.4), 2, 0.01)  # too few evaluations
    assert not plateau_reached(log(1.2, 1.4, 1.5, 1.52), 2, 0.01)  # 1.52 >= 1.4 + 0.01
    assert plateau_reached(log(1.2, 1.5, 1.505, 1.509), 2, 0.01)  # < 1.5 + 0.01 twice
    assert plateau_reached(log(1.2, 1.5, 1.45, 1.40), 2, 0.01)  # falling
    assert not plateau_reached(log(1.2, 1.5, 1.45, 1.60), 2, 0.01)  # a late rise counts


def test_plateau_patience_needs_eval_every():
    from pipeline.config import TrainConfig

    with pytest.raises(ValueError, match="eval_every"):
        TrainConfig(plateau_patience=3)
    assert TrainConfig(plateau_patience=3, eval_every=10).plateau_patience == 3
