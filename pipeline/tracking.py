"""Weights & Biases for the whole run: one W&B run per run directory, whatever stage or resume.

The run id is created once and stored as ``<run_dir>/wandb_run_id``, so training (in the Ray Train
rank-0 worker), its resumes, calibration and evaluation all log into the same run (``resume=
"allow"``). Offline by default: files go under ``<run_dir>/train/wandb`` and ``wandb sync`` uploads
them later. What is logged: the training curves (pipeline/train/worker.py), the run's target,
layer ids and cache manifest in the run config, the drafter checkpoint as a ``model`` artifact, the
calibration report (table per position, reliability diagram) and the evaluation (table per dataset
and temperature, conditional-acceptance plots).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from .run_layout import RunLayout

RUN_ID_FILE = "wandb_run_id"


def run_id(run_dir: Path) -> str:
    """The W&B run id of this run directory (created on first use)."""
    path = Path(run_dir) / RUN_ID_FILE
    if path.is_file():
        return path.read_text().strip()
    rid = f"dspark-{secrets.token_hex(4)}"
    path.write_text(rid + "\n")
    return rid


def open_run(wandb_cfg: dict, run_dir: Path, name: str, job_type: str, config: dict | None = None):
    """The run directory's W&B run (resumed), or None when ``wandb.mode`` is disabled.

    Args:
        wandb_cfg: the ``wandb`` config section as a dict (project, entity, mode).
        run_dir: the pipeline's run directory (holds the run id and the offline files).
        name: display name; job_type: what this process does (train, calibrate, eval).
        config: merged into the run's config.
    """
    if wandb_cfg.get("mode", "offline") == "disabled":
        return None
    import wandb

    wandb_dir = RunLayout(Path(run_dir)).wandb_dir
    wandb_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_SILENT", "true")
    return wandb.init(project=wandb_cfg.get("project"), entity=wandb_cfg.get("entity"),
                      mode=wandb_cfg.get("mode", "offline"), dir=str(wandb_dir),
                      id=run_id(run_dir), resume="allow", name=name, job_type=job_type,
                      config=config or {}, reinit="finish_previous")


def log_drafter_artifact(run, drafter_dir: Path, name: str, metadata: dict | None = None) -> None:
    """The drafter checkpoint directory as a ``model`` artifact of ``run``."""
    import wandb

    art = wandb.Artifact(name, type="model", metadata=metadata or {})
    art.add_dir(str(drafter_dir))
    run.log_artifact(art)


def log_calibration(run, report: dict, out_dir: Path) -> None:
    """STS results: one table row per draft position, and the reliability diagram."""
    import wandb

    rows = report.get("positions") or []
    if rows:
        cols = sorted({k for r in rows for k in r if not isinstance(r[k], (list, dict))})
        run.log({"calibration/positions": wandb.Table(columns=cols,
                                                      data=[[r.get(c) for c in cols] for r in rows])})
    diagram = out_dir / "reliability.png"
    if diagram.is_file():
        run.log({"calibration/reliability": wandb.Image(str(diagram))})


def log_evaluation(run, report: dict, out_dir: Path) -> None:
    """Evaluation: one table row per (dataset, temperature), the domain averages, and the
    conditional-acceptance plots."""
    import wandb

    cols = ["dataset", "temperature", "prompts", "tau", "speedup", "spec_tokens_per_s",
            "target_tokens_per_s", "accept_rate@1"]
    data = [[name, float(t), s["prompts"], s["tau"], s.get("speedup"), s["spec_tokens_per_s"],
             s.get("target_tokens_per_s"), (s["accept_rate"] or [None])[0]]
            for name, by_t in report["results"].items() for t, s in by_t.items()]
    run.log({"eval/results": wandb.Table(columns=cols, data=data),
             **{f"eval/tau_{d}_T{t}": v for t, doms in report["domains"].items()
                for d, v in doms.items()}})
    for png in sorted(out_dir.glob("conditional_acceptance_T*.png")):
        run.log({f"eval/{png.stem}": wandb.Image(str(png))})
