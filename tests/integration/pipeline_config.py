"""Builds a small pipeline config around the tiny target for the integration tests."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def write_prompts(path: Path, n: int = 12) -> Path:
    rows = [{"id": f"p{i:03d}", "domain": "math",
             "messages": [{"role": "user", "content": f"Count from {i} to {i + 5} in words."}]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_pipeline_config(tmp_path: Path, target_dir: Path, *, cache_output: str | None = None,
                         storage_options: dict | None = None, n_prompts: int = 12) -> Path:
    prompts = write_prompts(tmp_path / "prompts.jsonl", n_prompts)
    cfg = {
        "run_dir": str(tmp_path / "run"),
        "storage_options": storage_options or {},
        "target": {"name_or_path": str(target_dir), "dtype": "float32", "layer_ids": [1, 3]},
        "prompts": {"sources": [{"path": str(prompts)}], "heldout_fraction": 0.2},
        "generate": {"sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                  "max_new_tokens": 24},
                     "batch_size": 8, "num_threads": 1},
        "cache": {"output": cache_output, "max_length": 128, "rows_per_shard": 4,
                  "rows_per_row_group": 2, "num_threads": 1},
        "drafter": {"num_layers": 1, "block_size": 4, "markov_rank": 16},
        "train": {"num_workers": 2, "num_threads": 1, "micro_batch_size": 1,
                  "global_batch_size": 2, "num_epochs": 2, "num_anchors": 8, "lr": 3e-3},
        "calibrate": {"max_prompts": 4, "max_new_tokens": 24, "num_threads": 1,
                      "dtype": "float32"},
        "eval": {"data_dir": str(ROOT / "infra" / "datasets" / "eval"),
                 "datasets": {"gsm8k": 2}, "max_new_tokens": 12, "num_threads": 1,
                 "dtype": "float32"},
        "wandb": {"mode": "offline"},
        # fixed gamma: every round verifies a block, so the report's tau and acceptance are
        # defined; dspark's choices follow SPS(B) profiled on whatever else the machine runs
        "engine": {"scheduler": "fixed"},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path
