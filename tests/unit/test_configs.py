"""Every shipped pipeline config validates against the schema (STYLE 16)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "infra" / "configs").glob("*.yaml"))
PIPELINE = [p for p in CONFIGS if "applications" not in yaml.safe_load(p.read_text())]


@pytest.mark.parametrize("path", PIPELINE, ids=lambda p: p.name)
def test_pipeline_config_validates(path):
    cfg = load_config(path)
    assert cfg.target.name_or_path and cfg.prompts.sources


def test_drafter_quality_config_trains_the_baselines_like_dspark():
    """The benchmark's contenders differ only in the drafter section."""
    from benchmarks.drafter_quality import CONTENDERS, contender_config

    base = Path(__file__).resolve().parents[2] / "infra" / "configs" / "drafter_quality.yaml"
    cfgs = {name: contender_config(base, name, []) for name in CONTENDERS}  # all validate
    for name, cfg in cfgs.items():
        assert cfg.drafter.drafter_type == name.split("-")[0]  # ablations are DSpark drafters
        assert cfg.eval == cfgs["dspark"].eval
        assert cfg.train == cfgs["dspark"].train or name in ("dspark-ce_heavy", "dspark-soft_ce")
        assert cfg.run_dir.endswith(name)
    changed = {k for k, v in cfgs["dspark-block_4"].drafter.model_dump().items()
               if v != cfgs["dspark"].drafter.model_dump()[k]}
    assert changed == {"block_size"}
    ce_heavy = cfgs["dspark-ce_heavy"]
    assert ce_heavy.drafter == cfgs["dspark"].drafter
    assert tuple(ce_heavy.train.loss_weights) == (0.9, 0.1, 1.0)
    assert cfgs["dspark"].train.loss_weights != ce_heavy.train.loss_weights
    soft_ce = cfgs["dspark-soft_ce"]
    assert soft_ce.drafter == cfgs["dspark"].drafter and soft_ce.drafter.confidence_head
    assert (soft_ce.train.objective, cfgs["dspark"].train.objective) == ("soft_ce", None)
    assert soft_ce.train.model_copy(update={"objective": None}) == cfgs["dspark"].train


SERVE = [p for p in CONFIGS if p not in PIPELINE]


@pytest.mark.parametrize("path", SERVE, ids=lambda p: p.name)
def test_serve_config_args_validate(path):
    from serve.app import ServeConfig

    apps = yaml.safe_load(path.read_text())["applications"]
    for app in apps:
        assert app["import_path"] == "serve.app:build_app"
        ServeConfig.model_validate(app["args"])


def test_benchmarks_that_train_on_the_quickstart_config_still_load_it():
    """The quickstart fine-tunes the shipped drafter (train.init_from); the fault matrix resumes
    (train.resume_from, which excludes init_from) and must say init_from=null to load at all."""
    from benchmarks import fault_matrix
    from pipeline.config import load_config

    cfg = load_config(str(fault_matrix.CONFIG), fault_matrix.SMALL)
    assert cfg.train.resume_from == "latest" and cfg.train.init_from is None
    assert load_config(str(fault_matrix.CONFIG)).train.init_from  # the quickstart's own
