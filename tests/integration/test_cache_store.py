"""Target cache round trip (SPEC 1.4) through a local directory and an S3 endpoint, with resume,
corruption detection and fail-fast on an unreachable bucket."""

from __future__ import annotations

import hashlib
import io
import json

import pyarrow.parquet as pq
import pytest
import torch

from pipeline import storage
from pipeline.cache.stage import CacheTarget, run_cache_split
from pipeline.cache.format import (CorruptShardError, build_manifest, decode_row, read_manifest,
                                   verify_shard)
from pipeline.config import CacheConfig
from serve.engine.chat import tokenize_conversation
from serve.engine.target_loading import load_target, load_tokenizer

from .conftest import conversations

pytestmark = [pytest.mark.slow, pytest.mark.ray]
LAYERS = [1, 3]


def _write(cache_dir, split, convs, target_dir, so):
    return run_cache_split(
        convs, cache_dir, split, CacheTarget(str(target_dir), "float32", LAYERS, {}),
        CacheConfig(max_length=256, min_supervised_tokens=5, rows_per_shard=4,
                    rows_per_row_group=2, num_threads=1), so)


def _check_round_trip(cache_dir, shards, convs, target_dir, so):
    """Every stored row equals a fresh forward of the target, to bf16 precision."""
    tok = load_tokenizer(str(target_dir))
    model = load_target(str(target_dir), "float32")
    manifest = build_manifest(target="tiny", revision=None, layer_ids=LAYERS,
                              hidden_size=model.config.hidden_size,
                              vocab_size=model.config.vocab_size, template_sha256="x",
                              template_kwargs={}, max_length=256, splits={"train": shards})
    storage.write_bytes_atomic(storage.join(cache_dir, "manifest.json"),
                               json.dumps(manifest).encode(), so)
    manifest = read_manifest(cache_dir, so)
    assert manifest["splits"]["train"]["rows"] == len(convs)
    assert manifest["bytes_per_token"] == (len(LAYERS) + 1) * 64 * 2 + 5
    by_id = {c["id"]: c for c in convs}
    seen = []
    for shard in manifest["splits"]["train"]["shards"]:
        verify_shard(cache_dir, "train", shard, so)
        data = storage.read_bytes(storage.join(cache_dir, "train", shard["file"]), so)
        for row in pq.read_table(io.BytesIO(data)).to_pylist():
            s = decode_row(row, 64, len(LAYERS))
            seen.append(s["sample_id"])
            ref = tokenize_conversation(tok, by_id[s["sample_id"]]["messages"], {}, 256)
            assert s["input_ids"].tolist() == ref.input_ids
            assert s["loss_mask"].tolist() == ref.loss_mask
            with torch.no_grad():
                out = model.model(input_ids=s["input_ids"][None], output_hidden_states=True)
            ctx = torch.cat([out.hidden_states[l + 1][0] for l in LAYERS], -1)
            torch.testing.assert_close(s["context_hidden"].float(), ctx, rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(s["last_hidden"].float(), out.last_hidden_state[0],
                                       rtol=1e-2, atol=1e-2)
            # the LM head applied to last_hidden gives the target's own logits
            logits = model.lm_head(s["last_hidden"].float())
            assert (logits.argmax(-1) == model(s["input_ids"][None]).logits[0].argmax(-1)).float().mean() > 0.95
    assert sorted(seen) == sorted(by_id)


def test_local_round_trip_resume_and_corruption(tmp_path, tiny_target_dir, ray_local):
    convs = conversations(6)
    cache_dir = str(tmp_path / "cache")
    shards = _write(cache_dir, "train", convs, tiny_target_dir, {})
    assert [s["rows"] for s in shards] == [4, 2]
    _check_round_trip(cache_dir, shards, convs, tiny_target_dir, {})

    # resume: only the shard whose completion sidecar is missing is rewritten
    first = tmp_path / "cache" / "train" / "shard-00000.parquet"
    mtime = first.stat().st_mtime_ns
    (tmp_path / "cache" / "train" / "shard-00001.json").unlink()
    again = _write(cache_dir, "train", convs, tiny_target_dir, {})
    assert first.stat().st_mtime_ns == mtime
    assert [s["sha256"] for s in again] == [s["sha256"] for s in shards]

    # a corrupted shard is caught by its manifest hash, naming the file
    data = bytearray(first.read_bytes())
    data[len(data) // 2] ^= 0xFF
    first.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match="shard-00000.parquet"):
        verify_shard(cache_dir, "train", read_manifest(cache_dir)["splits"]["train"]["shards"][0])


def test_bad_samples_are_reported_not_written(tmp_path, tiny_target_dir, ray_local):
    convs = conversations(3)
    convs[1]["messages"][1]["content"] = "ok"  # too few supervised tokens
    shards = _write(str(tmp_path), "train", convs, tiny_target_dir, {})
    assert shards[0]["rows"] == 2
    [err] = shards[0]["errors"]
    assert err["id"] == "c01" and "supervised tokens" in err["error"]


def test_s3_round_trip_and_training_read(tiny_target_dir, ray_local, s3_endpoint):
    convs = conversations(5)
    cache_dir = "s3://dspark-test/run1/cache"
    storage.check_writable(cache_dir, s3_endpoint)
    shards = _write(cache_dir, "train", convs, tiny_target_dir, s3_endpoint)
    _check_round_trip(cache_dir, shards, convs, tiny_target_dir, s3_endpoint)
    # the trainer's read path: Ray Data over the same bucket, parquet files only
    fs, path = storage.get_arrow_fs(storage.join(cache_dir, "train"), s3_endpoint)
    ds = ray_local.data.read_parquet(path, filesystem=fs, file_extensions=["parquet"])
    assert sorted(r["sample_id"] for r in ds.iter_rows()) == sorted(c["id"] for c in convs)


def test_unreachable_bucket_fails_fast_naming_it(s3_endpoint):
    with pytest.raises(ConnectionError, match="s3://no-such-bucket/x"):
        storage.check_writable("s3://no-such-bucket/x", s3_endpoint)
    dead = dict(s3_endpoint, endpoint_url="http://127.0.0.1:9",
                config_kwargs={"connect_timeout": 1, "retries": {"max_attempts": 1}})
    with pytest.raises(ConnectionError, match="s3://dspark-test/x"):
        storage.check_writable("s3://dspark-test/x", dead)


def _through(proxy, s3_endpoint) -> dict:
    return dict(s3_endpoint, endpoint_url=f"http://127.0.0.1:{proxy.port}")


def test_throttled_uploads_are_retried_and_the_cache_is_complete(tiny_target_dir, ray_local,
                                                                 s3_endpoint):
    """Every second upload answered with 503 SlowDown (issue 12, item 4): the writes retry and
    every shard arrives intact."""
    from tests.faulty_s3 import FaultyS3Proxy

    upstream = int(s3_endpoint["endpoint_url"].rsplit(":", 1)[1])
    proxy = FaultyS3Proxy(upstream, lambda method, path, nth: nth % 2 == 0)
    try:
        so = _through(proxy, s3_endpoint)
        convs = conversations(5)
        cache_dir = "s3://dspark-test/throttled/cache"
        shards = _write(cache_dir, "train", convs, tiny_target_dir, so)
        assert proxy.injected >= 2
        _check_round_trip(cache_dir, shards, convs, tiny_target_dir, s3_endpoint)
    finally:
        proxy.close()


def test_an_upload_that_finally_fails_leaves_no_object_and_a_clear_error(s3_endpoint):
    """Every upload of one key fails: the write raises S3's error after its retries and nothing
    is visible at the final key (an S3 object appears only when its upload completes)."""
    from tests.faulty_s3 import FaultyS3Proxy

    upstream = int(s3_endpoint["endpoint_url"].rsplit(":", 1)[1])
    proxy = FaultyS3Proxy(upstream, lambda method, path, nth: "doomed" in path)
    try:
        so = dict(_through(proxy, s3_endpoint), config_kwargs={"retries": {"max_attempts": 2}})
        path = "s3://dspark-test/faults/doomed-shard.parquet"
        with pytest.raises(OSError, match="upload of s3://dspark-test/faults/doomed-shard"
                                          ".parquet failed.*reduce your request rate") as err:
            storage.write_bytes_atomic(path, b"x" * 1000, so)
        assert proxy.injected >= 2, "the failed upload was retried"
        assert not storage.exists(path, s3_endpoint), type(err.value)
        storage.write_bytes_atomic("s3://dspark-test/faults/fine.parquet", b"y", so)  # others go
        assert storage.read_bytes("s3://dspark-test/faults/fine.parquet", s3_endpoint) == b"y"
    finally:
        proxy.close()


def _big_rows(n: int, t: int = 256, width: int = 1024) -> list[dict]:
    """Rows of ~1 MB (incompressible bytes): a few of them fill an S3 multipart part."""
    import numpy as np

    rng = np.random.default_rng(n)
    return [{"sample_id": f"b{i:03d}", "domain": "x", "num_tokens": t,
             "input_ids": rng.integers(0, 1000, t, dtype="<i4").tobytes(),
             "loss_mask": np.ones(t, dtype=np.uint8).tobytes(),
             "context_hidden": rng.bytes(2 * t * width), "last_hidden": rng.bytes(2 * t * width)}
            for i in range(n)]


def _s3(so):
    import boto3

    return boto3.client("s3", endpoint_url=so["endpoint_url"], aws_access_key_id="testing",
                        aws_secret_access_key="testing", region_name="us-east-1")


def test_s3_shard_streams_as_a_multipart_upload_visible_only_when_complete(s3_endpoint):
    """Row groups go out as multipart parts while the shard is written; the object exists only
    after close, and equals a plain Parquet read of the rows."""
    from pipeline.cache.writer import ShardWriter

    client, rows = _s3(s3_endpoint), _big_rows(24)
    base = "s3://dspark-test/stream/train/shard-00000"
    key = "stream/train/shard-00000.parquet"
    so = dict(s3_endpoint, default_block_size=5 * 2**20)  # 5 MiB parts (S3's smallest)
    with ShardWriter(base, so, rows_per_row_group=4) as writer:
        writer.write_rows(rows[:12])
        uploads = client.list_multipart_uploads(Bucket="dspark-test").get("Uploads", [])
        assert [u["Key"] for u in uploads] == [key], "parts are uploaded before the shard ends"
        assert not storage.exists(base + ".parquet", s3_endpoint)
        writer.write_rows(rows[12:])
        summary = writer.close()
    assert not client.list_multipart_uploads(Bucket="dspark-test").get("Uploads")
    data = storage.read_bytes(base + ".parquet", s3_endpoint)
    assert summary["bytes"] == len(data) and summary["rows"] == 24
    assert pq.read_table(io.BytesIO(data)).to_pylist() == rows


def test_s3_shard_failing_mid_upload_is_aborted_then_rewritten_after_backoff(s3_endpoint):
    """Every part upload fails until the S3 client's own retries are spent: the shard's
    multipart upload is aborted (nothing visible, no upload left open); after a backoff the whole
    shard is written again, completely."""
    from pipeline.cache.writer import write_shard
    from tests.faulty_s3 import FaultyS3Proxy

    upstream = int(s3_endpoint["endpoint_url"].rsplit(":", 1)[1])
    outage = {"on": True}
    proxy = FaultyS3Proxy(upstream, lambda method, path, nth: outage["on"] and "partNumber" in path)
    client = _s3(s3_endpoint)
    base, rows, delays = "s3://dspark-test/retry/train/shard-00000", _big_rows(12), []

    def backoff(delay_s):  # the outage ends while the writer waits
        assert not client.list_multipart_uploads(Bucket="dspark-test").get("Uploads"), \
            "the failed upload was aborted"
        assert not storage.exists(base + ".parquet", s3_endpoint)
        delays.append(delay_s)
        outage["on"] = False

    try:
        so = dict(_through(proxy, s3_endpoint), default_block_size=5 * 2**20,
                  config_kwargs={"retries": {"max_attempts": 1}})
        summary = storage.retry_transient(
            lambda: write_shard(base, rows, rows_per_row_group=4, storage_options=so),
            what=base, sleep=backoff)
    finally:
        proxy.close()
    assert proxy.injected >= 2 and delays == [2.0]
    assert not client.list_multipart_uploads(Bucket="dspark-test").get("Uploads")
    data = storage.read_bytes(base + ".parquet", s3_endpoint)
    assert summary["sha256"] == hashlib.sha256(data).hexdigest()
    assert pq.read_table(io.BytesIO(data)).to_pylist() == rows
    assert json.loads(storage.read_bytes(base + ".json", s3_endpoint)) == summary
