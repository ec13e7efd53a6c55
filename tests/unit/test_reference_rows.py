"""The shipped reference rows (``infra/datasets/regenerated/smollm2_reference/``) answer exactly
the prompts ``infra/configs/smollm2_reference.yaml`` draws: a change to the prompt selection that
moved the split would silently throw hours of regeneration away (the generate stage resumes by
row id)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from pipeline import storage
from pipeline.config import load_config
from pipeline.prompts import load_prompts

ROOT = Path(__file__).resolve().parents[2]
ROWS = ROOT / "infra" / "datasets" / "regenerated" / "smollm2_reference"


def _ids(name: str) -> list[str]:
    with gzip.open(ROWS / name, "rt", encoding="utf-8") as f:
        return [json.loads(line)["id"] for line in f]


def test_the_shipped_rows_are_the_reference_configs_split():
    cfg = load_config(str(ROOT / "infra" / "configs" / "smollm2_reference.yaml"))
    p = cfg.prompts
    split = load_prompts([(storage.resolve(s.path), s.max_rows) for s in p.sources],
                         p.heldout_fraction, p.seed, cfg.storage_options)
    train, heldout = _ids("train.jsonl.gz"), _ids("heldout.jsonl.gz")
    assert len(set(train)) == len(train) and len(set(heldout)) == len(heldout)
    assert set(heldout) == {r["id"] for r in split.heldout}
    wanted = {r["id"] for r in split.train}
    assert set(train) <= wanted
    # only prompts beyond generate.max_prompt_tokens are left unanswered (the stage's error file)
    assert len(wanted) - len(train) == 11


def test_the_grown_reference_config_keeps_the_heldout_rows_and_reuses_the_answers():
    """smollm2_reference_xl.yaml is compared with the reference on the same held-out prompts, and
    its generate stage takes the reference answers it asks for again instead of regenerating."""
    from pipeline.prompts import read_ids

    cfg = load_config(str(ROOT / "infra" / "configs" / "smollm2_reference_xl.yaml"))
    p = cfg.prompts
    heldout_ids = read_ids(storage.resolve(p.heldout_ids_from))
    split = load_prompts([(storage.resolve(s.path), s.max_rows) for s in p.sources],
                         p.heldout_fraction, p.seed, cfg.storage_options, heldout_ids=heldout_ids)
    assert {r["id"] for r in split.heldout} == set(_ids("heldout.jsonl.gz"))
    train = {r["id"] for r in split.train}
    assert not train & heldout_ids and len(train) > 2 * len(_ids("train.jsonl.gz"))
    reused = train & set(_ids("train.jsonl.gz"))
    assert len(reused) > 4000
    assert {storage.resolve(f) for f in cfg.generate.reuse_from} == {
        str(ROWS / "train.jsonl.gz"), str(ROWS / "heldout.jsonl.gz")}
