"""The size planner (pipeline/plan.py): counts, bytes and steps for a config as written."""

from __future__ import annotations

import gzip
import json

import pytest
import yaml

from pipeline.config import load_config
from pipeline.plan import bytes_per_token, main, plan


def _config(tmp_path, cache_manifest: dict | None = None):
    row = json.dumps({"id": "x", "messages": [{"role": "user", "content": "hi"}]})
    (tmp_path / "a.jsonl").write_text("\n".join([row] * 30) + "\n")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as fh:
        fh.write("\n".join([row] * 50) + "\n\n")
    cfg = {"run_dir": str(tmp_path / "run"), "target": {"name_or_path": "/nowhere"},
           "prompts": {"sources": [{"path": str(tmp_path / "a.jsonl")},
                                   {"path": str(tmp_path / "b.jsonl.gz"), "max_rows": 20}],
                       "heldout_fraction": 0.1},
           }
    cfg["cache"] = {"rows_per_shard": 8}
    cfg["train"] = {"global_batch_size": 4, "micro_batch_size": 2, "num_workers": 2,
                    "num_epochs": 3}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    if cache_manifest is not None:
        (tmp_path / "run" / "cache").mkdir(parents=True)
        (tmp_path / "run" / "cache" / "manifest.json").write_text(json.dumps(cache_manifest))
    return load_config(str(path), [])


def test_plan_counts_rows_bytes_shards_and_steps(tmp_path):
    cfg = _config(tmp_path, {"splits": {"train": {"rows": 9, "tokens": 900},
                                        "heldout": {"rows": 1, "tokens": 100}}})
    p = plan(cfg, hidden_size=64, num_layers=6, tokens_per_sample=None, bandwidth_gb_s=0.001)
    assert p.bytes_per_token == bytes_per_token(64, 5) == 6 * 64 * 2 + 5
    assert (p.prompts, p.train_rows, p.heldout_rows) == (50, 45, 5)  # 30 + min(50, 20)
    assert p.tokens_per_sample == 100 and "manifest" in p.tokens_per_sample_source
    assert p.total_bytes == 50 * 100 * p.bytes_per_token
    assert p.shards == 6 + 1 and p.files == 15  # ceil(45/8) + ceil(5/8); 2 per shard + manifest
    assert p.write_s == pytest.approx(p.total_bytes / 1e6)
    assert (p.steps_per_epoch, p.train_steps) == (11, 33)
    assert p.answer_tokens_max == 50 * 4096  # prompts x the default max_new_tokens


def test_plan_sizes_the_regeneration(tmp_path, capsys):
    _config(tmp_path)
    assert main(["--config", str(tmp_path / "config.yaml"), "--hidden-size", "64",
                 "--num-layers", "6", "--tokens-per-sample", "200",
                 "--set", "generate.sampling.max_new_tokens=360",
                 "--generate-tokens-per-s", "100"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("answer tokens"))
    assert "18.0 Ktokens" in line and "3.0 min at 100 tokens/s" in line  # 50 x 360 / 100 s


def test_cli_needs_tokens_per_sample_without_a_manifest(tmp_path, capsys):
    _config(tmp_path)
    assert main(["--config", str(tmp_path / "config.yaml"), "--hidden-size", "64",
                 "--num-layers", "6"]) == 2
    assert "--tokens-per-sample" in capsys.readouterr().err
    assert main(["--config", str(tmp_path / "config.yaml"), "--hidden-size", "64",
                 "--num-layers", "6", "--tokens-per-sample", "200", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total_tokens"] == 50 * 200


def test_memory_line_needs_the_target_config_and_uses_it(tmp_path, capsys):
    from transformers import AutoConfig

    from pipeline.memory import estimate_for_config

    cfg = _config(tmp_path)
    args = ["--config", str(tmp_path / "config.yaml"), "--hidden-size", "64", "--num-layers", "6",
            "--tokens-per-sample", "200"]
    assert main(args) == 0
    assert "needs the target's config (--target-config)" in capsys.readouterr().out
    target = {"model_type": "qwen3", "hidden_size": 64, "vocab_size": 512,
              "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "intermediate_size": 128, "tie_word_embeddings": True}
    (tmp_path / "target.json").write_text(json.dumps(target))
    assert main(args + ["--target-config", str(tmp_path / "target.json")]) == 0
    assert "% of 80.0 GB" in capsys.readouterr().out
    assert main(args + ["--target-config", str(tmp_path / "target.json"), "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    expected = estimate_for_config(cfg, AutoConfig.from_pretrained(tmp_path / "target.json"))
    assert memory["total"] == expected.total > 0


def test_plan_prints_the_row_group_size(tmp_path, capsys):
    """Row groups as the cache writer cuts them (cache.rows_per_row_group and
    cache.row_group_bytes), at Qwen3-8B shapes: H 4096, 5 context layers, 49,157 B per token."""
    _config(tmp_path)
    args = ["--config", str(tmp_path / "config.yaml"), "--hidden-size", "4096", "--num-layers",
            "36", "--tokens-per-sample", "1000"]
    assert main(args) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("row groups"))
    # a 1,000-token row is 49.2 MB: 10 fit 512 MiB; a 4,096-token row 201.3 MB: 2 fit
    assert "10 rows of ~491.6 MB (mean sample), 2 of 402.7 MB at cache.max_length" in line
    assert "at most 16 rows and 536.9 MB" in line and "error" not in line
    assert main(args + ["--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert (p["row_group_rows"], p["row_group_rows_at_max_length"]) == (10, 2)
    assert p["row_group_bytes_at_max_length"] == 2 * 4096 * bytes_per_token(4096, 5)
    # a sample whose context_hidden alone is past 2 GiB cannot be cached: said on that line
    assert main(["--config", str(tmp_path / "config.yaml"), "--hidden-size", "8192",
                 "--num-layers", "80", "--tokens-per-sample", "1000",
                 "--set", "cache.max_length=32768"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("row groups"))
    assert "error: a 32768-token sample's context_hidden" in line


def test_plan_sizes_the_feature_stream_of_online_training(tmp_path, capsys):
    """Online: every epoch's forwards (num_epochs x the cache's one pass), the host memory of the
    stream, the producer rate that keeps the trainers busy and the time per epoch."""
    cfg = _config(tmp_path)
    online = cfg.model_copy(update={"train": cfg.train.model_copy(update={
        "data_mode": "online", "stream_object_store_gib": 1.0, "stream_shuffle_rows": 8})})
    p = plan(online, hidden_size=64, num_layers=6, tokens_per_sample=100, bandwidth_gb_s=1,
             train_step_s=0.5, feature_tokens_per_s=1000.0)
    per_token = bytes_per_token(64, 5)
    epoch_tokens = p.train_rows * 100
    assert p.stream["forward_tokens"] == 3 * epoch_tokens
    assert p.stream["extra_forward_tokens"] == 2 * epoch_tokens
    # 2 trainers x (3 micro-batches of 2 rows + 8 shuffle rows) x 100 tokens, on top of the cap
    assert p.stream["bytes_in_flight"] == 2**30 + 2 * (3 * 2 + 8) * 100 * per_token
    assert p.stream["feature_tokens_per_s_needed"] == 4 * 100 / 0.5
    assert p.stream["epoch_forward_s"] == epoch_tokens / 1000.0
    hybrid = plan(cfg.model_copy(update={"train": cfg.train.model_copy(update={
        "data_mode": "hybrid"})}), hidden_size=64, num_layers=6, tokens_per_sample=100,
        bandwidth_gb_s=1)
    assert hybrid.stream["forward_tokens"] == epoch_tokens
    assert hybrid.stream["extra_forward_tokens"] == 0
    assert main(["--config", str(tmp_path / "config.yaml"), "--hidden-size", "64",
                 "--num-layers", "6", "--tokens-per-sample", "100", "--set",
                 "train.data_mode=online", "--train-step-s", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "online: stores nothing" in out and "800 tokens/s" in out
