"""pipeline.release: a finished run's calibrated drafter packaged in bf16 with its records."""

import gzip
import json
import time

import pytest
import torch

from drafters.loading import load_drafter
from pipeline.config import load_config
from pipeline.release import ReleaseError, cache_summary, last_heldout_evaluation, main, release
from pipeline.stages import stage_fingerprint
from tests.tiny import tiny_drafter, tiny_target

CONFIG = ("run_dir: {run}\ntarget: {{name_or_path: {target}}}\n"
          "prompts: {{sources: [{{path: p.jsonl}}]}}\n")
LOG = [{"step": 1, "tau": 1.1, "loss": 3.0},
       {"step": 2, "tau": 1.3, "loss": 2.5, "heldout_tau": 1.2, "heldout_accept_rate@1": 0.2},
       {"step": 3, "tau": 1.4, "loss": 2.4}]


@pytest.fixture
def finished_run(tmp_path):
    """A run directory as the pipeline leaves it after calibrate and eval (tiny drafter)."""
    target = tiny_target()
    drafter = tiny_drafter(target, draft_vocab=[0, 1, 2, 5, 7, 9, 11, 13])
    run = tmp_path / "run"
    src = run / "calibrate" / "drafter"
    drafter.save_pretrained(src)
    (src / "training_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in LOG))
    (src / "sps_profile.json").write_text("{}")  # hardware-specific: must not be released
    (run / "calibrate" / "_SUCCESS.json").write_text(json.dumps({"calibrated": True}))
    (run / "config.yaml").write_text(CONFIG.format(run=run, target="tiny-qwen3"))
    fingerprint = stage_fingerprint(load_config(run / "config.yaml"), "eval")
    (run / "eval").mkdir()
    (run / "eval" / "_SUCCESS.json").write_text(json.dumps({"config_fingerprint": fingerprint}))
    (run / "eval" / "report.md").write_text("# Evaluation\n")
    (run / "eval" / "report.json").write_text(json.dumps(
        {"domains": {"0.0": {"macro": 2.6}, "1.0": {"macro": 2.1}}, "scheduler": "dspark",
         "fixed_gamma": {"domains": {"0.0": {"macro": 2.9}, "1.0": {"macro": 2.3}}}}))
    (run / "cache").mkdir()
    (run / "cache" / "manifest.json").write_text(json.dumps(
        {"format": "dspark-target-cache/v1", "layer_ids": [1, 3],
         "splits": {"train": {"rows": 4, "tokens": 100, "supervised_tokens": 60,
                              "token_frequency": [[5, 9], [7, 3]]}}}))
    return target, drafter, run


def test_release_is_bf16_and_loads_to_the_same_drafter(finished_run, tmp_path):
    target, drafter, run = finished_run
    out = tmp_path / "release"
    info = release(run, out)
    assert sorted(p.name for p in out.iterdir()) == sorted([
        "config.json", "model.safetensors", "training_config.yaml", "eval_report.md",
        "eval_report.json", "calibration.json", "cache_summary.json", "training_log.jsonl.gz",
        "release.json", "README.md"])
    from safetensors.torch import load_file
    weights = load_file(str(out / "model.safetensors"))
    assert {v.dtype for v in weights.values() if v.is_floating_point()} == {torch.bfloat16}
    assert weights["d2t"].dtype == torch.int64  # the draft vocabulary map is not cast
    # the release loaded in bf16 is the source loaded in bf16, parameter for parameter
    a = load_drafter(run / "calibrate" / "drafter", target, "tiny-qwen3", dtype=torch.bfloat16)
    b = load_drafter(out, target, "tiny-qwen3", dtype=torch.bfloat16)
    for name, p in a.state_dict().items():
        assert torch.equal(p, b.state_dict()[name]), name
    assert info["trainable_parameters"] == sum(
        v.numel() for v in drafter.state_dict().values() if v.is_floating_point())
    assert info["heldout"] == {"step": 2, "tau": 1.2, "accept_rate@1": 0.2}
    assert info["eval_macro_tau"] == {"0.0": 2.6, "1.0": 2.1}
    assert info["eval_scheduler"] == "dspark"
    assert info["eval_macro_tau_fixed_gamma"] == {"0.0": 2.9, "1.0": 2.3}
    assert json.loads((out / "release.json").read_text()) == info
    with gzip.open(out / "training_log.jsonl.gz", "rt") as fh:
        assert [json.loads(line) for line in fh] == LOG
    summary = json.loads((out / "cache_summary.json").read_text())
    assert summary["splits"] == {"train": {"rows": 4, "tokens": 100, "supervised_tokens": 60}}
    card = (out / "README.md").read_text()
    assert "accept_rate@1 0.200, tau 1.20" in card and "T=0.0: 2.60, T=1.0: 2.10 with the dspark scheduler" in card
    assert "(fixed gamma, the paper's Table 1 convention): T=0.0: 2.90, T=1.0: 2.30" in card


def test_release_refuses_unfinished_runs_oversize_and_overwrites(finished_run, tmp_path):
    _, _, run = finished_run
    out = tmp_path / "release"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ReleaseError, match="exists; pass --force"):
        release(run, out)
    assert (out / "keep.txt").read_text() == "mine"
    with pytest.raises(ReleaseError, match="over --max-mb"):
        release(run, out, max_mb=0.001, force=True)
    assert (out / "keep.txt").read_text() == "mine"  # nothing replaced by a refused release
    assert sorted(p.name for p in tmp_path.iterdir()) == ["release", "run"]  # no leftovers
    release(run, out, force=True)  # --force replaces it whole
    assert not (out / "keep.txt").exists() and (out / "release.json").is_file()
    log = (out / "training_log.jsonl.gz").read_bytes()
    time.sleep(1.1)  # gzip stamps whole seconds: a later second must not change the bytes
    release(run, out, force=True)  # a re-release of the same run writes the same bytes
    assert (out / "training_log.jsonl.gz").read_bytes() == log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["release", "run"]
    for inside in (run, run / "calibrate", run / "calibrate" / "drafter", tmp_path):
        with pytest.raises(ReleaseError, match="overlaps the run directory"):
            release(run, inside, force=True)
    assert (run / "calibrate" / "drafter" / "config.json").is_file()
    (run / "eval" / "_SUCCESS.json").unlink()
    with pytest.raises(ReleaseError, match="eval stage has not finished"):
        release(run, tmp_path / "other")
    assert main(["--run", str(run), "--out", str(tmp_path / "other")]) == 2
    assert not (tmp_path / "other").exists()


def test_release_refuses_a_rewritten_config_and_names_damaged_records(finished_run, tmp_path):
    _, _, run = finished_run
    (run / "eval" / "report.json").write_text("{not json")
    with pytest.raises(ReleaseError, match="report.json: unreadable"):
        release(run, tmp_path / "a")
    (run / "config.yaml").write_text(CONFIG.format(run=run, target="other"))
    with pytest.raises(ReleaseError, match="not the config the run's stages ran under"):
        release(run, tmp_path / "a")
    assert main(["--run", str(run), "--out", str(tmp_path / "a")]) == 2
    assert not (tmp_path / "a").exists()


def test_summaries_drop_tables_and_find_the_last_evaluation():
    assert cache_summary({"splits": {"heldout": {"rows": 1, "token_frequency": []}}, "x": 1}) == {
        "x": 1, "splits": {"heldout": {"rows": 1}}}
    assert last_heldout_evaluation(LOG[:1]) == {}
