"""The cache's head check (issue 42): the target's LM head on the cached final state reproduces the
target's own logits, and a cache built from the pre-norm state fails the stage by name."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.cache.check import CacheHeadMismatchError
from pipeline.config import CacheConfig
from pipeline.target_features import CacheTarget

CONVERSATIONS = [{"id": f"c{i}", "domain": "math", "messages": [
    {"role": "user", "content": f"What is {i} plus {i + 2}?"},
    {"role": "assistant", "content": f"{i} plus {i + 2} is {2 * i + 2}. Adding them: done."}]}
    for i in range(3)]


@pytest.fixture
def writer(tiny_target_dir):
    from pipeline.cache.stage import CacheWriterUDF

    udf = CacheWriterUDF(CacheTarget(str(tiny_target_dir), "float32", [1, 3, 4], {}),
                         CacheConfig(max_length=128, num_threads=1), {})
    # the saved final norm is all ones (a fresh init): then a pre-norm state differs from the
    # head's input by one scale per position only; a trained norm weighs every channel
    with torch.no_grad():
        udf.model.model.norm.weight.copy_(torch.linspace(0.2, 3.0, udf.model.config.hidden_size))
    return udf


def _pre_norm_forward(udf, monkeypatch):
    """The cache forward with the final norm switched off while it runs: it caches the state
    before the norm (the bug the check exists for) while the target itself is unchanged."""
    forward, norm = udf.forward, udf.model.model.norm

    def cached_pre_norm(samples):
        udf.model.model.norm = torch.nn.Identity()
        try:
            return forward(samples)
        finally:
            udf.model.model.norm = norm
    monkeypatch.setattr(udf, "forward", cached_pre_norm)


def test_first_shard_passes_the_head_check_and_records_it(writer, tmp_path):
    summary = writer.write_shard(str(tmp_path / "train" / "shard-00000"), CONVERSATIONS, "fp")
    check = summary["head_check"]
    assert check["relative_error"] < 1e-2 and check["top1_agreement"] == 1.0
    assert check["positions"] > 0
    sidecar = json.loads((tmp_path / "train" / "shard-00000.json").read_text())
    assert sidecar["head_check"] == check
    later = writer.write_shard(str(tmp_path / "train" / "shard-00001"), CONVERSATIONS, "fp")
    assert "head_check" not in later  # a sample: the first shard of each split


def test_a_pre_norm_cache_fails_by_shard_and_keeps_no_sidecar(writer, tmp_path, monkeypatch):
    _pre_norm_forward(writer, monkeypatch)
    base = tmp_path / "train" / "shard-00000"
    with pytest.raises(CacheHeadMismatchError, match=r"shard-00000\.parquet, sample c\d.*pre-norm"):
        writer.write_shard(str(base), CONVERSATIONS, "fp")
    assert not (tmp_path / "train" / "shard-00000.json").exists()  # a re-run writes it again
