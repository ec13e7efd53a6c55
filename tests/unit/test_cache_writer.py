"""The cache writer (pipeline/cache/stage.py, cache_writer.py, pipeline/storage.py): shards stream row
group by row group to a temporary that becomes visible only when complete, a failure leaves nothing
behind, the hidden states are stored without dictionary encoding, transient store errors are retried
with backoff, and batched target forwards give the rows a per-sample forward gives."""

from __future__ import annotations

import errno
import hashlib

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pipeline import storage
from pipeline.cache.stage import CacheTarget, CacheWriterUDF, length_batches
from pipeline.cache.format import SCHEMA
from pipeline.cache.writer import (ShardWriter, row_group_sizes, supervised_token_counts,
                                   write_shard)
from pipeline.config import CacheConfig


def _rows(n: int, t: int = 40, width: int = 64) -> list[dict]:
    rng = np.random.default_rng(n)
    return [{"sample_id": f"s{i}", "domain": "code", "num_tokens": t,
             "input_ids": rng.integers(0, 500, t, dtype="<i4").tobytes(),
             "loss_mask": (np.arange(t) >= t // 3).astype(np.uint8).tobytes(),
             "context_hidden": rng.normal(size=(t, 2 * width)).astype(np.float32)
                                  .view(np.uint32).__rshift__(16).astype("<u2").tobytes(),
             "last_hidden": rng.integers(0, 2**16, t * width, dtype="<u2").tobytes()}
            for i in range(n)]


def test_a_shard_streams_through_a_temporary_and_appears_only_when_complete(tmp_path):
    base = str(tmp_path / "train" / "shard-00000")
    rows = _rows(7)
    with ShardWriter(base, {}, rows_per_row_group=3) as writer:
        writer.write_rows(rows[:3])
        [tmp] = list((tmp_path / "train").glob(".shard-00000.parquet.tmp-*"))
        first = tmp.stat().st_size
        assert first > 3 * 40 * 64 * 2, "the first row group is on disk before the shard ends"
        writer.write_rows(rows[3:])
        assert tmp.stat().st_size > first
        assert not (tmp_path / "train" / "shard-00000.parquet").exists()
        summary = writer.close()
    assert not list((tmp_path / "train").glob(".*tmp*"))
    path = tmp_path / "train" / "shard-00000.parquet"
    data = path.read_bytes()
    assert summary["bytes"] == len(data) and summary["sha256"] == hashlib.sha256(data).hexdigest()
    assert summary["rows"] == 7 and summary["tokens"] == 7 * 40
    assert summary["supervised_token_counts"] == supervised_token_counts(rows)
    assert summary["supervised_tokens"] == sum(summary["supervised_token_counts"].values())
    meta = pq.ParquetFile(path).metadata
    assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == [3, 3, 1]
    assert pq.read_table(path).to_pylist() == rows
    names = SCHEMA.names
    for g in range(meta.num_row_groups):
        for col in ("context_hidden", "last_hidden", "input_ids"):
            chunk = meta.row_group(g).column(names.index(col))
            assert not any("DICTIONARY" in e for e in chunk.encodings), (col, chunk.encodings)
            assert chunk.compression == "ZSTD" and chunk.statistics is None


def test_a_failure_mid_shard_leaves_neither_shard_nor_temporary(tmp_path):
    base = str(tmp_path / "shard-00003")
    with pytest.raises(RuntimeError, match="target died"):
        with ShardWriter(base, {}, rows_per_row_group=2) as writer:
            writer.write_rows(_rows(4))
            raise RuntimeError("target died")
    assert list(tmp_path.iterdir()) == []


def test_write_shard_writes_the_sidecar_after_the_shard(tmp_path):
    summary = write_shard(str(tmp_path / "shard-00000"), _rows(5), rows_per_row_group=2,
                          storage_options={}, extra={"errors": []})
    import json

    assert json.loads((tmp_path / "shard-00000.json").read_text()) == summary
    assert summary["file"] == "shard-00000.parquet" and summary["errors"] == []


def test_a_full_disk_leaves_no_temporary(tmp_path):
    writer = storage.AtomicWriter(str(tmp_path / "x.parquet"))

    class FullDisk:
        def __init__(self, fh):
            self.fh = fh

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            self.fh.close()

    writer._fh = FullDisk(writer._fh)
    with pytest.raises(OSError, match="No space left"):
        with writer:
            writer.write(b"abc")
    assert list(tmp_path.iterdir()) == []
    assert not storage.is_transient(OSError(errno.ENOSPC, "No space left on device"))


def test_transient_errors_are_retried_with_backoff_and_others_are_not():
    calls, sleeps = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OSError(errno.EIO, "upload failed: SlowDown")
        return "done"

    assert storage.retry_transient(flaky, what="t", base_delay_s=1.5, sleep=sleeps.append) == "done"
    assert sleeps == [1.5, 3.0]
    for permanent in (FileNotFoundError("no bucket"), PermissionError("denied"),
                      ValueError("bad data")):
        calls.clear()

        def fail(err=permanent):
            calls.append(1)
            raise err

        with pytest.raises(type(permanent)):
            storage.retry_transient(fail, what="t", sleep=sleeps.append)
        assert len(calls) == 1
    calls.clear()

    def down():
        calls.append(1)
        raise OSError(errno.EIO, "SlowDown")

    with pytest.raises(OSError, match="SlowDown"):  # attempts spent: the last error
        storage.retry_transient(down, what="t", attempts=3, sleep=lambda s: None)
    assert len(calls) == 3


def test_length_batches_cover_every_sample_once_within_the_token_budget():
    lengths = [5, 40, 12, 40, 33, 7, 100, 9, 12]
    batches = length_batches(lengths, 64)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        longest = max(lengths[i] for i in b)
        assert lengths[b[0]] == longest
        assert len(b) == 1 or len(b) * longest <= 64
    assert batches[0] == [6]  # longer than the budget: alone
    assert length_batches(lengths, 64) == batches  # deterministic
    assert all(len(b) == 1 for b in length_batches(lengths, 1))


def test_batched_forwards_give_the_rows_of_per_sample_forwards(tiny_target_dir, tmp_path):
    """Samples of mixed lengths forwarded right-padded in one batch: each row equals the row of
    its own forward (to bf16 rounding) and rows keep the conversations' order."""
    udf = CacheWriterUDF(CacheTarget(str(tiny_target_dir), "float32", [1, 3], {}),
                         CacheConfig(max_length=256, min_supervised_tokens=5,
                                     rows_per_row_group=4, num_threads=1,
                                     forward_batch_tokens=1 << 20), {})
    convs = [{"id": f"c{i}", "messages": [
        {"role": "user", "content": "Tell me something " + "long " * (3 * i)},
        {"role": "assistant", "content": f"Here it is: {'more words ' * (5 * i + 2)}done."}]}
        for i in range(4)]
    samples = [s for c in convs for s in udf.tokenize(c)]
    assert len({len(s["input_ids"]) for s in samples}) == 4
    batched = udf.forward(samples).to_pylist()
    udf.forward_batch_tokens = 1
    single = udf.forward(samples).to_pylist()
    assert [r["sample_id"] for r in batched] == [r["sample_id"] for r in single] == \
        ["c0", "c1", "c2", "c3"]
    as_f32 = lambda b: torch.frombuffer(bytearray(b), dtype=torch.bfloat16).float()
    for a, b in zip(batched, single):
        assert a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"]
        for col in ("context_hidden", "last_hidden"):
            assert len(a[col]) == len(b[col])
            torch.testing.assert_close(as_f32(a[col]), as_f32(b[col]), rtol=2e-2, atol=2e-2)
    # a whole shard: streamed, sidecar last, rows in conversation order
    summary = udf.write_shard(str(tmp_path / "shard-00000"), convs, "fp")
    assert summary["rows"] == 4 and summary["fingerprint"] == "fp"
    assert pq.read_table(tmp_path / "shard-00000.parquet").column("sample_id").to_pylist() == \
        ["c0", "c1", "c2", "c3"]
    assert pq.ParquetFile(tmp_path / "shard-00000.parquet").metadata.num_row_groups == 1
    # row groups cut by bytes as well (cache.row_group_bytes), planned from the token counts
    row_bytes = [len(s["input_ids"]) * udf.bytes_per_token for s in samples]
    assert udf.bytes_per_token == (2 + 1) * 64 * 2 + 5
    udf.row_group_bytes = row_bytes[0] + row_bytes[1]
    udf.write_shard(str(tmp_path / "shard-00001"), convs, "fp")
    meta = pq.ParquetFile(tmp_path / "shard-00001.parquet").metadata
    groups = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    assert groups == row_group_sizes(row_bytes, 4, udf.row_group_bytes) == [2, 1, 1]
    assert pq.read_table(tmp_path / "shard-00001.parquet").equals(
        pq.read_table(tmp_path / "shard-00000.parquet"))


def test_shards_are_cut_in_cache_order_and_mix_the_sources():
    """The driver-side plan (ids only) and the packing step cut the conversations, sorted by
    their hashed-id key (``cache_format.shard_key``), every N rows, and fingerprint each shard;
    blank and truncated lines of the generate output are skipped; repeated ids refused. Ids
    that start with their source's name land in shards of mixed sources."""
    import json

    from pipeline.cache.shards import (_assign_shard, _key_lines, _pack_shard, shard_bounds,
                                       shard_fingerprint)
    from pipeline.cache.format import shard_key

    convs = [{"id": f"{src}-{i:02d}", "domain": "math", "messages": [
        {"role": "user", "content": f"q{i} é"}, {"role": "assistant", "content": f"a{i}"}]}
        for src in ("alpha", "beta") for i in (7, 3, 9, 0, 4, 1, 8, 2, 6, 5)]
    lines = np.array([json.dumps(c, ensure_ascii=False) for c in convs] + ["", '{"id": "c1'],
                     dtype=object)
    keyed = _key_lines({"text": lines}, "train")
    assert set(keyed["split"]) == {"train"}
    assert sorted(keyed["id"]) == sorted(c["id"] for c in convs)
    bounds = shard_bounds(list(keyed["id"]), 8)
    ordered = sorted(convs, key=lambda c: shard_key(c["id"]))
    assert bounds == [shard_key(ordered[8]["id"]), shard_key(ordered[16]["id"])]
    # another split's rows in the same batch are cut by that split's own bounds
    other = _key_lines({"text": lines[:6]}, "heldout")
    other_bounds = shard_bounds(list(other["id"]), 2)  # 6 rows, 3 shards
    both = _assign_shard({k: np.concatenate([keyed[k], other[k]]) for k in keyed},
                         {"train": bounds, "heldout": other_bounds})
    assert sorted(both["shard"][-6:]) == [0, 0, 1, 1, 2, 2]
    assert list(both["shard"][-6:]) == list(np.searchsorted(
        np.array(other_bounds, dtype=object), other["key"], side="right"))
    assert list(both["shard"][:-6]) == list(_assign_shard(keyed, {"train": bounds})["shard"])
    keyed = _assign_shard(keyed, {"train": bounds})
    settings = {"target": "t", "summary": 2}
    for shard in range(3):
        pick = keyed["shard"] == shard
        packed = _pack_shard({k: v[pick] for k, v in keyed.items()}, "/cache", settings)
        assert packed["split"][0] == "train"
        want = ordered[8 * shard:8 * shard + 8]
        assert json.loads(packed["rows"][0]) == want
        assert packed["fingerprint"][0] == shard_fingerprint(want, settings)
        assert packed["path"][0] == f"/cache/train/shard-{shard:05d}"
    first = {c["id"].split("-")[0] for c in ordered[:8]}
    assert first == {"alpha", "beta"}  # sorted by id alone, shard 0 would be all "alpha"
    with pytest.raises(ValueError, match="'c03' occurs more than once"):
        shard_bounds(["c01", "c03", "c03"], 2)


def test_rows_table_matches_the_dict_rows_and_sliced_tables_count_right(tmp_path):
    import pyarrow as pa

    from pipeline.cache.format import bf16_array
    from pipeline.cache.writer import rows_table

    torch.manual_seed(0)
    samples = [{"sample_id": f"s{i}", "domain": "d", "input_ids": list(range(5 + i)),
                "loss_mask": [0, 0] + [1] * (3 + i)} for i in range(3)]
    ctx = [torch.randn(5 + i, 8) for i in range(3)]
    last = [torch.randn(5 + i, 4) for i in range(3)]
    table = rows_table(samples, ctx, last)
    as_dicts = [{"sample_id": s["sample_id"], "domain": "d", "num_tokens": len(s["input_ids"]),
                 "input_ids": np.asarray(s["input_ids"], dtype="<i4").tobytes(),
                 "loss_mask": np.asarray(s["loss_mask"], dtype=np.uint8).tobytes(),
                 "context_hidden": bf16_array(c).tobytes(), "last_hidden": bf16_array(h).tobytes()}
                for s, c, h in zip(samples, ctx, last)]
    assert table.to_pylist() == as_dicts
    assert table.equals(pa.Table.from_pylist(as_dicts, schema=SCHEMA))
    with ShardWriter(str(tmp_path / "s"), {}, rows_per_row_group=2) as writer:
        writer.write_table(table.slice(1))  # a slice: offsets start inside the buffers
        summary = writer.close()
    assert summary["rows"] == 2 and summary["tokens"] == 6 + 7
    assert summary["supervised_token_counts"] == supervised_token_counts(as_dicts[1:])
