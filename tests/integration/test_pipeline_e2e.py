"""`pipeline/run.py` as a user runs it, on the tiny target: every stage, re-run skipping, and bad
input failing clearly without losing what was written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .pipeline_config import ROOT, tiny_pipeline_config

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def run_pipeline(config: Path, *extra: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "pipeline" / "run.py"), "--config",
                           str(config), *extra], capture_output=True, text=True, timeout=timeout)


def test_end_to_end_smoke_and_rerun(tmp_path, tiny_target_dir):
    config = tiny_pipeline_config(tmp_path, tiny_target_dir)
    # one malformed row among the prompts: reported with file and line, the others go on
    with open(tmp_path / "prompts.jsonl", "a") as fh:
        fh.write('{"id": "bad", "messages": [{"role": "user", "content": ""}]}\n')
    proc = run_pipeline(config, "--release", str(tmp_path / "release"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    released = json.loads((tmp_path / "release" / "release.json").read_text())
    assert released["dtype"] == "bfloat16" and released["source_run"] == str(run)
    assert (tmp_path / "release" / "config.json").read_bytes() == (
        run / "calibrate" / "drafter" / "config.json").read_bytes()
    # a second release never overwrites the first (checked before any stage runs)
    refused = run_pipeline(config, "--stages", "eval", "--release", str(tmp_path / "release"))
    assert refused.returncode == 2 and "exists; choose a new directory" in refused.stderr
    errors = [json.loads(l) for l in (run / "prompts" / "errors.jsonl").open()]
    assert errors == [{"file": str(tmp_path / "prompts.jsonl"), "line": 13, "id": "bad",
                       "error": "messages[0] (user) has empty or missing 'content'"}]
    generated = [json.loads(l) for l in (run / "generate" / "train.jsonl").open()]
    failed = [json.loads(l) for l in (run / "generate" / "errors.jsonl").open()]
    assert len(generated) + len(failed) == 10 and len({g["id"] for g in generated}) == len(generated)
    assert all(m["role"] == "assistant" for g in generated for m in g["messages"][1::2])
    manifest = json.loads((run / "cache" / "manifest.json").read_text())
    assert manifest["layer_ids"] == [1, 3] and manifest["splits"]["train"]["rows"] > 0
    assert (run / "train" / "drafter" / "config.json").exists()
    calibration = json.loads((run / "calibrate" / "report.json").read_text())
    assert (run / "calibrate" / "drafter" / "config.json").exists()
    if calibration["calibrated"]:  # enough full-block rounds on the tiny data
        temps = json.loads((run / "calibrate" / "drafter" / "config.json").read_text())
        assert temps["calibration_temperatures"] == calibration["temperatures"]
        assert (run / "calibrate" / "reliability.png").stat().st_size > 0
    else:
        assert "full-block rounds" in calibration["reason"]
    report = json.loads((run / "eval" / "report.json").read_text())
    cell = report["results"]["gsm8k"]
    assert set(cell) == {"0.0", "1.0"}
    for s in cell.values():
        assert s["prompts"] == 2 and s["tau"] >= 1.0 and s["target_tokens_per_s"] > 0
        assert len(s["accept_rate"]) == 4 and len(s["conditional_acceptance"]) == 4
    assert cell["0.0"]["greedy_identical_share"] == 1.0  # fp32: lossless greedy
    assert "| gsm8k | 1.0 | 2 |" in (run / "eval" / "report.md").read_text()
    assert report["domains"]["1.0"]["math"] == cell["1.0"]["tau"]
    assert (run / "eval" / "conditional_acceptance_T1.0.png").stat().st_size > 0
    # W&B (offline): training, its artifact, calibration and eval all log into one run id
    rid = (run / "wandb_run_id").read_text().strip()
    runs = sorted((run / "train" / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) >= 4 and all(r.name.endswith(rid) for r in runs), [r.name for r in runs]
    logged = b"".join(f.read_bytes() for r in runs for f in r.glob("*.wandb"))
    for needle in (b"drafter-run", b"eval/results", b"cache_manifest"):
        assert needle in logged, needle

    # re-running is cheap and duplicates nothing
    before = (run / "generate" / "train.jsonl").read_text()
    again = run_pipeline(config, "--stages", "prompts,generate,cache,train")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("complete, skipped") == 4
    assert (run / "generate" / "train.jsonl").read_text() == before

    # a grown run on the same held-out prompts takes the answers it asks for again
    grown = yaml.safe_load(config.read_text())
    extra = tmp_path / "more_prompts.jsonl"
    extra.write_text("".join(json.dumps({"id": f"new{i}", "domain": "chat", "messages": [
        {"role": "user", "content": f"Name {i + 2} colours."}]}) + "\n" for i in range(2)))
    grown["run_dir"] = str(tmp_path / "grown")
    grown["prompts"]["sources"].append({"path": str(extra)})
    grown["prompts"]["heldout_ids_from"] = str(run / "prompts" / "heldout.jsonl")
    grown["generate"]["reuse_from"] = [str(run / "generate" / f"{s}.jsonl")
                                       for s in ("train", "heldout")]
    (tmp_path / "grown.yaml").write_text(yaml.safe_dump(grown))
    proc = run_pipeline(tmp_path / "grown.yaml", "--stages", "prompts,generate")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ((tmp_path / "grown" / "prompts" / "heldout.jsonl").read_text()
            == (run / "prompts" / "heldout.jsonl").read_text())
    summary = json.loads((tmp_path / "grown" / "generate" / "_SUCCESS.json").read_text())
    assert summary["train"]["reused"] == len(generated)
    assert summary["train"]["generated"] + summary["train"]["errors"] == 2 + len(failed)
    rows = {json.loads(l)["id"]: json.loads(l)
            for l in (tmp_path / "grown" / "generate" / "train.jsonl").open()}
    assert all(rows[g["id"]] == g for g in generated) and {"new0", "new1"} <= rows.keys()

    # a shard damaged after writing: --repair-cache rewrites that shard alone, training re-runs
    shards = sorted((run / "cache" / "train").glob("shard-*.parquet"))
    untouched = {p: p.stat().st_mtime_ns for p in shards[1:]}
    data = bytearray(shards[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    shards[0].write_bytes(bytes(data))
    repaired = run_pipeline(config, "--stages", "train", "--repair-cache")
    assert repaired.returncode == 0, repaired.stderr[-3000:]
    assert "1 damaged shard(s) removed" in repaired.stderr and shards[0].name in repaired.stderr
    assert {p: p.stat().st_mtime_ns for p in shards[1:]} == untouched
    import hashlib

    listed = {s["file"]: s["sha256"] for s in json.loads(
        (run / "cache" / "manifest.json").read_text())["splits"]["train"]["shards"]}
    assert listed[shards[0].name] == hashlib.sha256(shards[0].read_bytes()).hexdigest()
    assert (run / "train" / "_SUCCESS.json").exists()
    clean = run_pipeline(config, "--stages", "cache", "--repair-cache")
    assert clean.returncode == 0 and "0 damaged shard(s) removed" in clean.stderr

    # a changed config is not silently skipped
    changed = run_pipeline(config, "--stages", "train", "--set", "train.lr=1e-4")
    assert changed.returncode == 1 and "--force train" in changed.stderr

    # --force redoes a stage from scratch and invalidates the later ones (the prompts stage: the
    # same code path as any other, without a Ray start)
    heldout = (run / "prompts" / "heldout.jsonl").read_text()
    (run / "prompts" / "heldout.jsonl").unlink()
    (run / "prompts" / "left_over.txt").write_text("from an earlier run")
    forced = run_pipeline(config, "--stages", "prompts", "--force", "prompts")
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert "stage prompts: starting" in forced.stderr
    assert (run / "prompts" / "heldout.jsonl").read_text() == heldout
    assert not (run / "prompts" / "left_over.txt").exists()  # redone from scratch
    for later in ("generate", "cache", "train", "calibrate", "eval"):
        assert not (run / later / "_SUCCESS.json").exists(), later


def test_unknown_model_fails_fast_naming_the_path(tmp_path, tiny_target_dir):
    config = tiny_pipeline_config(tmp_path, tmp_path / "no-such-model")
    proc = run_pipeline(config, timeout=120)
    assert proc.returncode == 1
    assert "unknown target model" in proc.stderr and str(tmp_path / "no-such-model") in proc.stderr


def test_bad_config_lists_every_field(tmp_path, tiny_target_dir):
    config = tiny_pipeline_config(tmp_path, tiny_target_dir)
    proc = run_pipeline(config, "--set", "train.lr=0", "--set", "cache.rows_per_shard=0",
                        "--set", "eval.colour=red", timeout=120)
    assert proc.returncode == 2
    for needle in ("3 problem(s)", "train.lr", "cache.rows_per_shard", "eval.colour: unknown key"):
        assert needle in proc.stderr


def test_unreachable_bucket_fails_before_work(tmp_path, tiny_target_dir, s3_endpoint):
    config = tiny_pipeline_config(
        tmp_path, tiny_target_dir, cache_output="s3://missing-bucket/cache",
        storage_options=dict(s3_endpoint, config_kwargs={"retries": {"max_attempts": 1}}))
    raw = yaml.safe_load(config.read_text())
    run = Path(raw["run_dir"])
    # the whole pipeline must fail before generating anything
    proc = run_pipeline(config, timeout=120)
    assert proc.returncode == 1
    assert "cannot reach s3://missing-bucket/cache" in proc.stderr
    assert not (run / "generate").exists()
