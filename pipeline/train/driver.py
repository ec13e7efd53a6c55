"""Train stage, the driver: Ray Train ``TorchTrainer`` + DeepSpeed over the target cache, streamed
through Ray Data (SPEC section 3).

The driver checks the inputs (cache shards, ``init_from``, storage), selects the draft
vocabulary, sizes the run and launches the workers (``pipeline/train/loop.py``) with one frozen
:class:`~pipeline.train.job.TrainJob`. Checkpoints are a Hugging Face drafter directory plus the
DeepSpeed training state, reported to Ray Train (``pipeline/train/state.py``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from drafters.draft_vocab import coverage, frequency_ranking
from drafters.loading import checkpoint_draft_vocab

from .. import storage
from ..cache.format import verify_shard
from ..checkpoints import latest_checkpoint, require_complete
from ..feature_stream import Checkpoints
from ..tracking import log_drafter_artifact, open_run, run_id
from .data import steps_per_epoch
from .job import CheckpointPlace, TrainJob
from .loop import train_loop_per_worker

if TYPE_CHECKING:
    from drafters.config import DrafterConfig

    from ..config import TrainConfig

logger = logging.getLogger(__name__)


class TrainingFailedError(RuntimeError):
    """The Ray Train run failed (its workers' errors in the message)."""


def run_train(*, cache_dir: str, manifest: dict, out_dir: Path, target: str, layer_ids: list[int],
              drafter: DrafterConfig, train: TrainConfig, wandb_cfg: dict,
              storage_options: dict, run_name: str, streams=None, stop_step: int | None = None
              ) -> dict:
    """Launch the trainer; copy the final drafter to ``out_dir/drafter``.

    Args:
        manifest: the cache's manifest; for streamed training (``streams``) one with the
            statistics of the stream and no shards (:func:`pipeline.train.modes.stream_manifest`).
        streams: None (read the cache at ``cache_dir``) or a function (the run's
            :class:`pipeline.feature_stream.Checkpoints`, total steps) -> the datasets ``train``
            and optionally ``heldout`` that stream the target features to the workers
            (:mod:`pipeline.feature_stream`): Ray Data datasets or dataset factories.
        stop_step: end training there, checkpointed, though the LR schedule runs to the
            planned total (hybrid's first epoch); None: the total.

    Raises:
        ValueError: the cache holds too few rows for one optimizer step.
        IncompleteCheckpointError: ``train.resume_from`` names a checkpoint directory that is
            missing or that some rank did not finish writing (``pipeline/checkpoints.py``).
        TrainingFailedError: training failed (the workers' errors in the message).
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    rows = manifest["splits"]["train"]["rows"]
    init_from = storage.resolve(train.init_from) if train.init_from else None
    if train.verify_cache:  # a damaged shard is named now, before any worker starts

        for split, info in manifest["splits"].items():
            for shard in info.get("shards", []):
                verify_shard(cache_dir, split, shard, storage_options)
    per_epoch = steps_per_epoch(rows, train.global_batch_size)
    if per_epoch < 1:
        raise ValueError(f"the cache has {rows} training rows: fewer than one global batch "
                         f"({train.global_batch_size})")
    draft_vocab, vocab_report = select_draft_vocab(manifest, drafter.draft_vocab_size, init_from)
    total = per_epoch * train.num_epochs
    if train.max_steps:
        total = min(total, train.max_steps)
    storage_path = train_storage_path(train, out_dir)
    storage.check_writable(storage_path, storage_options)  # a bad bucket or path fails now
    resume = None
    if train.resume_from == "latest":  # the newest complete one; incomplete ones are logged
        resume = latest_checkpoint(storage_path, run_name, storage_options)
        logger.info("resuming from %s", resume) if resume else logger.info(
            "train.resume_from is 'latest' but no complete checkpoint exists yet: starting at "
            "step 0")
    elif train.resume_from:
        resume = storage.resolve(train.resume_from)
        require_complete(resume, storage_options)
    else:  # an explicit fresh start: Ray Train would otherwise restore the run's old state
        fs = storage.get_fsspec(storage_path, storage_options)
        if fs.exists(storage.join(storage_path, run_name)):
            fs.rm(storage.join(storage_path, run_name), recursive=True)
    # this call's id, in every checkpoint it writes: its worker-group restarts continue from its
    # own newest checkpoint (pipeline.checkpoints.restore_choice)
    fit_id = uuid.uuid4().hex
    datasets, dataset_config = None, None
    if streams is not None:
        from ray.data import ExecutionOptions, ExecutionResources
        from ray.train import DataConfig

        datasets = streams(Checkpoints(storage_path, run_name, storage_options, resume, fit_id),
                           total)
        # back-pressure: the feature actors wait once this much streamed data is in flight; the
        # stream's blocks in input order, so the epochs arrive one after another (each trainer
        # still shuffles locally, train.stream_shuffle_rows)
        dataset_config = DataConfig(datasets_to_split=["train"], execution_options=ExecutionOptions(
            resource_limits=ExecutionResources(
                object_store_memory=train.stream_object_store_gib * 2**30),
            preserve_order=True))
    wandb_dir = out_dir / "wandb"
    wandb_dir.mkdir(parents=True, exist_ok=True)
    job = TrainJob(
        train=train, drafter=drafter, target=target, layer_ids=tuple(layer_ids),
        target_hidden_size=manifest["target"]["hidden_size"], total_steps=total,
        steps_per_epoch=per_epoch, stop_step=stop_step, manifest=manifest, cache_dir=cache_dir,
        checkpoints=CheckpointPlace(storage_path, storage_options, run_name, fit_id, resume),
        wandb=wandb_cfg, wandb_dir=str(wandb_dir), wandb_run_id=run_id(out_dir.parent),
        streamed=datasets is not None, streamed_heldout=bool(datasets and "heldout" in datasets),
        draft_vocab=tuple(draft_vocab) if draft_vocab is not None else None,
        init_from=storage.resolve(train.init_from) if train.init_from else None,
        torch_extensions_dir=os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "dspark_ray" / "torch_extensions")))
    train_fs, train_fs_path = storage.get_arrow_fs(storage_path, storage_options)
    resources = {"CPU": train.cpus_per_worker}
    if train.use_gpu:
        resources["GPU"] = 1
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config={"job": job},
        scaling_config=ScalingConfig(num_workers=train.num_workers, use_gpu=train.use_gpu,
                                     resources_per_worker=resources,
                                     placement_strategy=train.placement_strategy),
        run_config=RunConfig(
            # our filesystem object, so s3fs options (a custom endpoint, keys) reach Ray Train,
            # whose own s3:// parsing would ignore them
            name=run_name, storage_path=train_fs_path, storage_filesystem=train_fs,
            failure_config=FailureConfig(max_failures=train.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=train.num_to_keep)),
        datasets=datasets, dataset_config=dataset_config,
    )
    logger.info("training %d optimizer steps (%d per epoch) on %d rows", total, per_epoch, rows)
    try:
        result = trainer.fit()
    except Exception as err:  # Ray Train's WorkerGroupError carries the workers' tracebacks
        raise TrainingFailedError(f"training failed: {err}") from err
    if result.error is not None:
        raise TrainingFailedError(f"training failed: {result.error}") from result.error
    with result.checkpoint.as_directory() as ckpt:
        dest = out_dir / "drafter"
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(Path(ckpt) / "drafter", dest)
    run = open_run(wandb_cfg, out_dir.parent, run_name, "train")
    if run is not None:  # the trained drafter as a model artifact of the run directory's W&B run
        log_drafter_artifact(run, dest, f"drafter-{run_name}", {"steps": total,
                                                                "target": target})
        run.finish()
    if vocab_report:
        (dest / "draft_vocab.json").write_text(json.dumps(vocab_report, indent=1))
    # fewer than planned when training stopped at the held-out plateau
    steps = int((result.metrics or {}).get("step", total))
    return {"steps": steps, "rows": rows, "metrics": result.metrics or {}, "resumed_from": resume,
            "checkpoint": result.checkpoint.path, "draft_vocab": vocab_report}


def train_storage_path(train: TrainConfig, out_dir: Path) -> str:
    """Where Ray Train keeps the run's checkpoints: ``train.storage_path`` or
    ``<out_dir>/ray_train``."""
    return (storage.resolve(train.storage_path) if train.storage_path
            else str((out_dir / "ray_train").resolve()))


def select_draft_vocab(manifest: dict, size: int, init_from: str | None = None
                       ) -> tuple[list[int] | None, dict]:
    """The draft vocabulary and a report of its coverage per split (share of the cache's
    supervised tokens inside the subset): the top-``size`` target ids of the cache's
    supervised-token ranking (train split), or, for a run started from a drafter's weights
    (``init_from``, a local drafter directory), that drafter's own vocabulary: its sequential head
    and draft LM head rows are indexed by it, so the cache's ranking would scramble them.

    Returns:
        (draft vocabulary, most frequent first, or None for ``size`` 0; the report dict).
    Raises:
        ValueError: ``size`` exceeds the vocabulary, the cache predates token counting,
            ``init_from`` is a URL (the workers read a local drafter directory), or the
            ``init_from`` drafter's vocabulary has another size than ``size`` (both named).
        FileNotFoundError / DrafterCheckpointError: ``init_from`` is no readable drafter
            directory (:func:`drafters.loading.checkpoint_draft_vocab`).
    """
    if init_from:
        if storage.is_url(init_from):
            raise ValueError(f"train.init_from {init_from}: a drafter directory on this "
                             "filesystem (a shared path on a cluster), not a URL")
        ids = checkpoint_draft_vocab(init_from) or []
        if len(ids) != size:
            raise ValueError(f"train.init_from {init_from} has a draft vocabulary of {len(ids)} "
                             f"(0: the full target vocabulary), drafter.draft_vocab_size is {size}")
    if not size:
        return None, {}
    vocab = manifest["target"]["vocab_size"]
    if size > vocab:
        raise ValueError(f"drafter.draft_vocab_size {size} exceeds the target vocabulary ({vocab})")
    splits = manifest["splits"]
    if "token_frequency" not in splits["train"]:
        raise ValueError("the cache manifest has no token_frequency (written by an older version): "
                         "re-run the cache stage (--force cache) to use drafter.draft_vocab_size")
    counts = {name: {t: c for t, c in sp.get("token_frequency", [])} for name, sp in splits.items()}
    if init_from:
        source = f"train.init_from {init_from}"
    else:
        ids = frequency_ranking(counts["train"], vocab)[:size]
        source = "the cache's supervised-token ranking"
    report = {"draft_vocab_size": size, "source": source,
              "coverage": {name: round(coverage(c, ids), 5) for name, c in counts.items()}}
    logger.info("draft vocabulary: %d of %d target tokens from %s, supervised-token coverage %s",
                size, vocab, source, report["coverage"])
    return ids, report
