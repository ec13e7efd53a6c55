"""Bad input in every file a user hands in gets a message naming the file, line or field, and
nothing already written is lost (issue 12, item 8): prompt Parquet files, benchmark files, pipeline
and serve configs, drafter and target directories, a target cache of another target."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from drafters.config import DrafterCheckpointError
from drafters.loading import load_drafter
from pipeline.cache.format import CACHE_FORMAT, CacheMismatchError
from pipeline.config import ConfigError, load_config
from pipeline.data_stages import stage_cache
from pipeline.evaluate import EvalDataError, load_eval_prompts
from pipeline.model_stages import stage_train
from pipeline.prompts import PromptError, read_prompt_file
from pipeline.stages import StageContext
from serve.engine.target_loading import load_target
from tests.integration.pipeline_config import tiny_pipeline_config
from tests.tiny import tiny_drafter, tiny_target


# ------------------------------------------------------------------------------ prompt files
def test_parquet_prompt_rows_are_reported_by_row_and_the_rest_kept(tmp_path):
    path = tmp_path / "p.parquet"
    user = json.dumps([{"role": "user", "content": "2+2?"}])
    pq.write_table(pa.table({
        "id": ["a", "broken", "asst", "b"],
        "messages": [user, "[{not json", json.dumps([{"role": "assistant", "content": "x"}]),
                     user]}), path)
    rows, errors = read_prompt_file(str(path))
    assert [r["id"] for r in rows] == ["a", "b"]
    by_line = {e["line"]: e for e in errors}
    assert set(by_line) == {2, 3} and all(e["file"] == str(path) for e in errors)
    assert "not valid JSON" in by_line[2]["error"] and by_line[2]["id"] == "broken"
    assert "start with a user turn" in by_line[3]["error"]


def test_a_file_that_is_not_parquet_is_named(tmp_path):
    path = tmp_path / "p.parquet"
    path.write_text('{"id": "a"}\n')  # JSONL under a .parquet name
    with pytest.raises(PromptError, match=f"{path}: not a readable Parquet file"):
        read_prompt_file(str(path))


# --------------------------------------------------------------------------- benchmark files
@pytest.mark.parametrize("line, needle", [
    ("{not json", "Expecting property name"),
    ('{"question": "no turns"}', "'turns'"),
    ('{"turns": []}', "index out of range"),
    ('{"turns": ["  "]}', "non-empty"),
])
def test_benchmark_rows_are_named_by_file_and_line(tmp_path, line, needle):
    path = tmp_path / "bench.jsonl"
    path.write_text('{"turns": ["fine"]}\n' + line + "\n")
    with pytest.raises(EvalDataError, match=f"{path}:2: .*{needle}"):
        load_eval_prompts(path, 10, 0)


# ---------------------------------------------------------------------------------- configs
def test_config_errors_name_the_line_and_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_dir: x\ntarget:\n  name_or_path: [unclosed\n")
    with pytest.raises(ConfigError, match=r"(?s)bad\.yaml.*line 3"):
        load_config(bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(yaml.safe_dump({"run_dir": "x", "target": {"name_or_path": "t"},
                                     "train": {"lr": "fast"}}))
    with pytest.raises(ConfigError, match=r"(?s)wrong\.yaml.*train\.lr"):
        load_config(wrong)


def test_serve_config_errors_name_each_field():
    from pydantic import ValidationError

    from serve.app import build_app

    with pytest.raises(ValidationError) as err:
        build_app({"target": "t", "engine": {"max_num_requests": 0, "colour": "red"}})
    text = str(err.value)
    assert "engine.max_num_requests" in text and "engine.colour" in text


# --------------------------------------------------------------------- drafter directories
@pytest.fixture(scope="module")
def target_and_drafter(tmp_path_factory):
    target = tiny_target()
    path = tmp_path_factory.mktemp("drafter") / "drafter"
    tiny_drafter(target).save_pretrained(path)
    return target, path


def _edit_config(p: Path, **fields):
    (p / "config.json").write_text(json.dumps({**json.loads((p / "config.json").read_text()),
                                               **fields}))


def _edit_weights(p: Path, change):
    state = load_file(p / "model.safetensors")
    change(state)
    save_file(state, p / "model.safetensors")


def _first_matrix(state):
    return next(k for k, v in state.items() if v.ndim == 2)


@pytest.mark.parametrize("damage, file, needle", [
    (lambda p: (p / "config.json").write_text("{bad"), "config.json", "not a valid JSON"),
    (lambda p: _edit_config(p, block_size=-3), "config.json", "block_size must be in"),
    (lambda p: _edit_config(p, drafter_type="medusa"), "config.json", "drafter_type must be"),
    (lambda p: (p / "model.safetensors").write_bytes(b"\0" * 100), "model.safetensors",
     "damaged, or not the weights"),
    (lambda p: _edit_weights(p, lambda s: s.update({_first_matrix(s): torch.zeros(3, 3)})),
     "model.safetensors", "size mismatch"),
    (lambda p: _edit_weights(p, lambda s: s.pop(next(iter(s)))), "model.safetensors",
     "Missing key"),
])
def test_damaged_drafter_directories_name_the_file(tmp_path, target_and_drafter, damage, file,
                                                    needle):
    target, src = target_and_drafter
    path = tmp_path / "drafter"
    shutil.copytree(src, path)
    damage(path)
    with pytest.raises(DrafterCheckpointError, match=needle) as err:
        load_drafter(path, target, "tiny", allow_name_mismatch=True)
    assert str(path / file) in str(err.value)


def test_a_drafter_of_another_target_lists_every_mismatch(target_and_drafter):
    _, src = target_and_drafter
    other = tiny_target(vocab_size=128)
    with pytest.raises(ValueError, match="vocab"):
        load_drafter(src, other, "another-target")


# ---------------------------------------------------------------------- target directories
@pytest.mark.parametrize("content, needle", [
    ({}, "model_type"),
    ({"config.json": "{x"}, "not a valid JSON"),
    ({"config.json": json.dumps(tiny_target().config.to_dict())}, "no file named"),
])
def test_unloadable_target_directories_are_named(tmp_path, content, needle):
    for name, text in content.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(FileNotFoundError, match=needle) as err:
        load_target(str(tmp_path))
    assert str(tmp_path) in str(err.value)


# ------------------------------------------------------------------- a cache of another target
def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_cache_of_another_target_is_refused_and_left_intact(tmp_path, tiny_target_dir):
    """cache.output pointing at another target's cache: the cache stage refuses to overwrite it
    shard by shard, and training refuses to read it; every field that differs is named."""
    cache = tmp_path / "shared_cache"
    (cache / "train").mkdir(parents=True)
    (cache / "train" / "shard-00000.parquet").write_bytes(b"another target's rows")
    (cache / "manifest.json").write_text(json.dumps({
        "format": CACHE_FORMAT, "target": {"name_or_path": "Qwen/Qwen3-4B", "hidden_size": 2560,
                                           "vocab_size": 151936},
        "layer_ids": [1, 3], "splits": {"train": {"rows": 1, "shards": []}}}))
    before = _tree_digest(cache)
    ctx = StageContext.create(load_config(tiny_pipeline_config(tmp_path, tiny_target_dir,
                                                               cache_output=str(cache))))
    for stage in ("generate", "cache"):  # as if the earlier stages had completed
        (ctx.run_dir / stage).mkdir(parents=True, exist_ok=True)
        (ctx.run_dir / stage / "_SUCCESS.json").write_text("{}")
    for run_stage in (stage_cache, stage_train):
        with pytest.raises(CacheMismatchError) as err:
            run_stage(ctx)
        text = str(err.value)
        assert str(cache / "manifest.json") in text
        for field in ("target.name_or_path", "target.hidden_size", "target.vocab_size"):
            assert field in text
        assert "layer_ids" not in text  # the same layers: only what differs is named
    assert _tree_digest(cache) == before


def test_check_checkpoint_reads_config_and_weights_header(tmp_path, target_and_drafter):
    from drafters.loading import check_checkpoint

    _, src = target_and_drafter
    assert check_checkpoint(src).drafter_type == "dspark"
    path = tmp_path / "drafter"
    shutil.copytree(src, path)
    (path / "model.safetensors").write_bytes(b"\x10" + b"\0" * 50)
    with pytest.raises(DrafterCheckpointError, match="model.safetensors: damaged"):
        check_checkpoint(path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no drafter weights"):
        check_checkpoint(path)


def test_a_damaged_gzip_benchmark_file_is_named(tmp_path):
    path = tmp_path / "bench.jsonl.gz"
    path.write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(EvalDataError, match=f"{path}: unreadable"):
        load_eval_prompts(path, 10, 0)


def test_preflight_refuses_before_force_clears_anything(tmp_path, tiny_target_dir):
    """--force train with a damaged train.init_from: the check runs before the stage (and its
    outputs) are cleared."""
    from pipeline.stages import preflight

    bad = tmp_path / "bad_drafter"
    bad.mkdir()
    (bad / "config.json").write_text("{broken")
    ctx = StageContext.create(load_config(tiny_pipeline_config(tmp_path, tiny_target_dir)))
    drafter = ctx.run_dir / "train" / "drafter"
    drafter.mkdir(parents=True)
    (drafter / "model.safetensors").write_bytes(b"weights of an earlier run")
    cfg = ctx.cfg.model_copy(update={"train": ctx.cfg.train.model_copy(
        update={"init_from": str(bad)})})
    ctx = StageContext(cfg, ctx.run_dir, ctx.target, ctx.layer_ids, ctx.cache_dir)
    with pytest.raises(DrafterCheckpointError, match="config.json"):
        preflight(ctx, ["train"], forced=["train"])
    assert (drafter / "model.safetensors").read_bytes() == b"weights of an earlier run"


def test_preflight_names_a_missing_heldout_ids_or_reuse_file(tmp_path, tiny_target_dir):
    """prompts.heldout_ids_from and generate.reuse_from are checked before any stage runs, by
    field; a stage already complete does not read them, so they are not asked for then."""
    from pipeline.stages import preflight

    ctx = StageContext.create(load_config(tiny_pipeline_config(tmp_path, tiny_target_dir)))
    cfg = ctx.cfg.model_copy(update={
        "prompts": ctx.cfg.prompts.model_copy(update={"heldout_ids_from": str(tmp_path / "ids")}),
        "generate": ctx.cfg.generate.model_copy(update={"reuse_from": [str(tmp_path / "old")]})})
    ctx = StageContext(cfg, ctx.run_dir, ctx.target, ctx.layer_ids, ctx.cache_dir)
    with pytest.raises(FileNotFoundError, match=r"prompts.heldout_ids_from: no such file: .*ids"):
        preflight(ctx, ["prompts", "generate"], forced=[])
    with pytest.raises(FileNotFoundError, match=r"generate.reuse_from\[0\]: no such file: .*old"):
        preflight(ctx, ["generate"], forced=[])
    cfg = ctx.cfg.model_copy(update={
        "generate": ctx.cfg.generate.model_copy(update={"reuse_from": [str(tmp_path)]})})
    ctx = StageContext(cfg, ctx.run_dir, ctx.target, ctx.layer_ids, ctx.cache_dir)
    with pytest.raises(ValueError, match=r"generate.reuse_from\[0\]: .* is a directory"):
        preflight(ctx, ["generate"], forced=[])
    ctx.marker("generate").parent.mkdir(parents=True, exist_ok=True)
    ctx.marker("generate").write_text("{}")
    preflight(ctx, ["generate"], forced=[])  # complete: nothing to read
