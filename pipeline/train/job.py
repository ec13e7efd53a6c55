"""Train stage, what the driver hands every Ray Train worker: one frozen :class:`TrainJob`.

The driver (``pipeline/train/driver.py``) validates the inputs, sizes the run and builds the job once;
Ray pickles it to the workers (``pipeline/train/loop.py``), which unpack it on their first
line and never re-parse or re-derive any of it. The typed config sections travel as the driver
validated them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from drafters.config import DrafterConfig

    from ..config import TrainConfig


@dataclass(frozen=True)
class CheckpointPlace:
    """Where a run's checkpoints live and which one it continues from.

    Attributes:
        storage_path: Ray Train's storage root (local path or ``s3://`` URL).
        storage_options: fsspec options for it (s3fs keys, endpoint).
        run_name: the Ray Train run under the root.
        fit_id: this launch's id, written into every checkpoint it makes (a worker-group restart
            continues from its own newest one, ``pipeline.checkpoints.restore_choice``).
        resume_from: the checkpoint the driver chose to resume (URL or path), or None.
    """

    storage_path: str
    storage_options: dict
    run_name: str
    fit_id: str | None = None
    resume_from: str | None = None


@dataclass(frozen=True)
class TrainJob:
    """Everything a training worker needs.

    Attributes:
        train, drafter: the validated config sections.
        target: the target's name or path (its frozen embedding and LM head are loaded there).
        layer_ids: the target layers whose states the cache holds (m = len).
        target_hidden_size: H_t, the width of each cached layer state.
        total_steps: optimizer steps of the LR schedule; steps_per_epoch: of the train split.
        stop_step: end there, checkpointed (hybrid's streamed first epoch), or None = total; one
            past the total (a run shorter than that epoch, ``train.max_steps``) ends at the total.
        manifest: the cache manifest (for streamed training, the stream's statistics).
        cache_dir: the cache root read by offline training.
        streamed, streamed_heldout: whether the train (and held-out) rows arrive as Ray Data
            streams instead of cache shards.
        draft_vocab: the draft vocabulary's target ids, most frequent first, or None; its
            length is ``drafter.draft_vocab_size`` (the one definition: workers read this).
        init_from: a drafter checkpoint to start from (not a resume), or None.
        checkpoints: :class:`CheckpointPlace`.
        wandb: the ``wandb`` config section (mode, project, entity); wandb_dir: where it writes;
            wandb_run_id: the run directory's W&B run.
        torch_extensions_dir: where DeepSpeed builds its ops.
    Raises:
        ValueError: (at construction) a draft vocabulary of another size than the drafter's, a
            stop step below 1, or an empty epoch.
    """

    train: TrainConfig
    drafter: DrafterConfig
    target: str
    layer_ids: tuple[int, ...]
    target_hidden_size: int
    total_steps: int
    steps_per_epoch: int
    manifest: dict
    cache_dir: str
    checkpoints: CheckpointPlace
    wandb: dict
    wandb_dir: str
    wandb_run_id: str
    torch_extensions_dir: str
    stop_step: int | None = None
    streamed: bool = False
    streamed_heldout: bool = False
    draft_vocab: tuple[int, ...] | None = None
    init_from: str | None = None

    def __post_init__(self):
        size = len(self.draft_vocab) if self.draft_vocab is not None else 0
        if size != self.drafter.draft_vocab_size:
            raise ValueError(f"the job's draft vocabulary has {size} ids, drafter.draft_vocab_size "
                             f"is {self.drafter.draft_vocab_size}")
        if self.steps_per_epoch < 1 or self.total_steps < 0:
            raise ValueError(f"steps_per_epoch {self.steps_per_epoch} and total_steps "
                             f"{self.total_steps} must be >= 1 and >= 0")
        if self.stop_step is not None and self.stop_step < 1:
            raise ValueError(f"stop_step {self.stop_step} must be >= 1 (or None)")

    @property
    def end_step(self) -> int:
        """Where this launch stops training: ``stop_step``, at most the total."""
        return min(self.total_steps, self.stop_step or self.total_steps)

    @property
    def num_context_layers(self) -> int:
        """m, the cached target layers concatenated into each context feature."""
        return len(self.layer_ids)
