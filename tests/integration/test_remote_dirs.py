"""Publishing a directory to S3 (moto) and fetching it on another node: what the stages and serve
replicas do with a drafter on shared storage (``storage.upload_dir``, ``serve.engine.paths.local_copy``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import storage
from serve.engine.paths import local_copy


def test_upload_then_local_copy_round_trip_and_replace(tmp_path, s3_endpoint):
    src = tmp_path / "drafter"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"a": 1}')
    (src / "sub" / "w.bin").write_bytes(b"\x00\x01" * 1000)
    url = "s3://dspark-test/remote/drafter"
    storage.upload_dir(src, url, s3_endpoint)
    got = Path(local_copy(url, s3_endpoint))
    assert (got / "config.json").read_text() == '{"a": 1}'
    assert (got / "sub" / "w.bin").read_bytes() == b"\x00\x01" * 1000
    # a re-published directory replaces the old one whole: no stale file survives either copy
    (src / "sub" / "w.bin").unlink()
    (src / "config.json").write_text('{"a": 2}')
    storage.upload_dir(src, url, s3_endpoint)
    got = Path(local_copy(url, s3_endpoint))
    assert (got / "config.json").read_text() == '{"a": 2}'
    assert not (got / "sub").exists()


def test_local_copy_of_nothing_names_the_url(s3_endpoint):
    with pytest.raises(FileNotFoundError, match="s3://dspark-test/remote/missing"):
        local_copy("s3://dspark-test/remote/missing", s3_endpoint)


def test_local_paths_pass_through(tmp_path):
    assert local_copy(str(tmp_path)) == str(tmp_path)
