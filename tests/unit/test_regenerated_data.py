"""The shipped regenerated answers (infra/datasets/regenerated/smollm2_reference) are rows the
reference config's generate stage would resume from: its own training prompts' ids, each with the
prompt's user turns answered by the assistant, no id twice."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from pipeline import storage
from pipeline.config import load_config
from pipeline.prompts import load_prompts

ROOT = Path(__file__).resolve().parents[2]


def test_regenerated_rows_resume_the_reference_generate_stage():
    cfg = load_config(ROOT / "infra" / "configs" / "smollm2_reference.yaml")
    p = cfg.prompts
    split = load_prompts([(storage.resolve(s.path), s.max_rows) for s in p.sources],
                         p.heldout_fraction, p.seed, cfg.storage_options)
    prompts = {r["id"]: r for r in split.train}
    path = ROOT / "infra" / "datasets" / "regenerated" / "smollm2_reference" / "train.jsonl.gz"
    with gzip.open(path, "rt") as fh:
        rows = [json.loads(line) for line in fh]
    assert rows and len({r["id"] for r in rows}) == len(rows)
    for row in rows:
        prompt = prompts[row["id"]]  # a training prompt of this config, same split and seed
        assert row["domain"] == prompt["domain"]
        users = [m["content"] for m in row["messages"] if m["role"] == "user"]
        assert users == [m["content"] for m in prompt["messages"] if m["role"] == "user"]
        assert [m["role"] for m in row["messages"][1::2]] == ["assistant"] * (len(users))
        assert all(isinstance(m["content"], str) for m in row["messages"][1::2])
