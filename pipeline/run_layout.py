"""Where a run's outputs live: the stage names, said once, and every file and directory the
stages write under the run directory (:class:`RunLayout`). Stages and readers ask the layout for
an output instead of building its path, so a stage's directory or a file name changes here only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# the stages, in the order they run (pipeline/stages.py pairs each with its work)
PROMPTS, GENERATE, CACHE, TRAIN, CALIBRATE, EVAL = (
    "prompts", "generate", "cache", "train", "calibrate", "eval")
STAGE_ORDER = (PROMPTS, GENERATE, CACHE, TRAIN, CALIBRATE, EVAL)
SPLITS = ("train", "heldout")
MARKER = "_SUCCESS.json"


@dataclass(frozen=True)
class RunLayout:
    """The outputs of one run directory (paths only: nothing is created or read here).

    Args:
        run_dir: the run directory (resolved).
    """

    run_dir: Path

    # ------------------------------------------------------------------ any stage
    def stage_dir(self, stage: str) -> Path:
        """Stage ``stage``'s directory."""
        return self.run_dir / stage

    def marker(self, stage: str) -> Path:
        """Stage ``stage``'s completion marker (its summary, with the config fingerprint)."""
        return self.stage_dir(stage) / MARKER

    @property
    def config_file(self) -> Path:
        """The resolved config the run was made with."""
        return self.run_dir / "config.yaml"

    # ------------------------------------------------------------------ data stages
    def prompts(self, split: str) -> Path:
        """The validated prompts of ``split`` (JSONL)."""
        return self.stage_dir(PROMPTS) / f"{split}.jsonl"

    def generated(self, split: str) -> Path:
        """The regenerated conversations of ``split`` (JSONL, keyed by id)."""
        return self.stage_dir(GENERATE) / f"{split}.jsonl"

    def errors(self, stage: str) -> Path:
        """The rows stage ``stage`` could not use, with their reasons (JSONL)."""
        return self.stage_dir(stage) / "errors.jsonl"

    @property
    def default_cache_dir(self) -> Path:
        """The target cache when ``cache.output`` names none."""
        return self.stage_dir(CACHE)

    # ------------------------------------------------------------------ model stages
    def drafter(self, stage: str) -> Path:
        """The drafter directory stage ``stage`` (train or calibrate) writes."""
        return self.stage_dir(stage) / "drafter"

    @property
    def training_log(self) -> Path:
        """Every training step's metrics (JSONL), kept beside the trained drafter."""
        return self.drafter(TRAIN) / "training_log.jsonl"

    @property
    def ray_train_dir(self) -> Path:
        """Ray Train's checkpoints when ``train.storage_path`` names no shared storage."""
        return self.stage_dir(TRAIN) / "ray_train"

    @property
    def wandb_dir(self) -> Path:
        """The W&B offline runs of the run directory."""
        return self.stage_dir(TRAIN) / "wandb"

    @property
    def stream_errors(self) -> Path:
        """Conversations that made no sample in streamed training (JSONL)."""
        return self.stage_dir(TRAIN) / "stream_errors.jsonl"

    @property
    def calibration_report(self) -> Path:
        return self.stage_dir(CALIBRATE) / "report.json"

    @property
    def reliability_plot(self) -> Path:
        return self.stage_dir(CALIBRATE) / "reliability.png"

    def eval_report(self, suffix: str = "json") -> Path:
        """The eval stage's report, ``json`` or ``md``."""
        return self.stage_dir(EVAL) / f"report.{suffix}"

    @property
    def engine_files(self) -> Path:
        """STS temperatures and SPS(B) tables for SGLang and TensorRT-LLM."""
        return self.stage_dir(EVAL) / "engine_files"


DATA_STAGES = (PROMPTS, GENERATE, CACHE)


def link_stages(src: Path, dest: Path, names=DATA_STAGES) -> None:
    """Link stages ``names`` of the run directory ``src`` into the run directory ``dest`` (e.g. a
    benchmark's arms sharing one run's data stages: their fingerprints match where only later
    sections differ). A stage ``dest`` already has is left as it is."""
    dest.mkdir(parents=True, exist_ok=True)
    for stage in names:
        link = RunLayout(dest).stage_dir(stage)
        if not link.exists() and not link.is_symlink():
            link.symlink_to(RunLayout(src).stage_dir(stage), target_is_directory=True)
