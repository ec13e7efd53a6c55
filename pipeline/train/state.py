"""Train stage, checkpoints: what a Ray Train worker writes at a checkpoint (DeepSpeed state, the
drafter directory, the training log, ``train_state.json``, the completion marker) and how a
worker group resumes from one, at the same or another worker count (``pipeline/checkpoints.py``
holds the on-storage format and the choice of the checkpoint).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from argparse import Namespace
from typing import TYPE_CHECKING

from .. import storage
from ..checkpoints import (
    STATE,
    checkpoint_url,
    local_files,
    parse_train_state,
    restore_choice,
    train_state_bytes,
    write_marker,
)

if TYPE_CHECKING:
    from .job import CheckpointPlace

logger = logging.getLogger(__name__)


def save_training_state(engine, step: int, world: int, history: list[dict], metrics: dict,
                        place: CheckpointPlace, extra_files: dict[str, str] | None = None) -> None:
    """Report a Ray Train checkpoint: DeepSpeed state (model, optimizer, LR schedule; every rank
    writes its shard), the HF drafter directory, the training log and ``train_state.json``; then,
    once every rank's upload has returned, rank 0 marks it complete (``pipeline/checkpoints.py``:
    the marker lists every rank's files and sizes, so ``resume_from: latest`` can tell a
    checkpoint some rank did not finish from a complete one). All workers call this together.
    ``extra_files`` ({name: text}) are written into the checkpoint too (by the ranks given any).

    Raises:
        OSError: writing the completion marker failed (the checkpoint then counts as incomplete).
    """
    import ray.train
    import torch.distributed as dist
    from ray.train import Checkpoint

    rank = ray.train.get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_checkpoint(os.path.join(tmp, "deepspeed"), tag="state")
        if rank == 0:
            engine.module.save_pretrained(os.path.join(tmp, "drafter"))
            with open(os.path.join(tmp, "drafter", "training_log.jsonl"), "w") as fh:
                fh.writelines(json.dumps(h) + "\n" for h in history)
            with open(os.path.join(tmp, STATE), "wb") as fh:
                fh.write(train_state_bytes(step, world, place.fit_id))
        for name, text in (extra_files or {}).items():  # e.g. the stream's consumed samples
            with open(os.path.join(tmp, name), "w") as fh:
                fh.write(text)
        rank_files = [None] * world
        dist.all_gather_object(rank_files, local_files(tmp))
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp))
    # report returns once this rank's files are uploaded: past the barrier, every rank's are
    dist.barrier()
    if rank == 0:
        write_marker(checkpoint_url(ray.train.get_checkpoint().path, place.storage_path),
                     step, rank_files, place.storage_options)


def resume_checkpoint(place: CheckpointPlace):
    """The ``ray.train.Checkpoint`` this worker group continues from, or None (step 0); the same
    on every worker (rank 0 chooses with :func:`pipeline.checkpoints.restore_choice`, from Ray
    Train's restored checkpoint and the driver's ``resume_from``, and broadcasts the choice).
    Call it on all workers together, after the process group is up."""
    import ray.train
    import torch.distributed as dist

    so, storage_path = place.storage_options, place.storage_path
    choice = [None]
    if ray.train.get_context().get_world_rank() == 0:
        restored = ray.train.get_checkpoint()
        choice[0] = restore_choice(
            checkpoint_url(restored.path, storage_path) if restored is not None else None,
            place.resume_from, storage_path, place.run_name, so, place.fit_id)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    fs, path = storage.get_arrow_fs(choice[0], so)
    return ray.train.Checkpoint(path, filesystem=fs)


def load_training_log(checkpoint_dir: str, step: int) -> list[dict]:
    """The training log of a checkpoint's run up to ``step`` (a resumed run continues it, so the
    final drafter's ``training_log.jsonl`` covers every step); [] if the checkpoint has none."""
    path = os.path.join(checkpoint_dir, "drafter", "training_log.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as fh:
        return [h for h in map(json.loads, fh) if h["step"] <= step]


def load_training_state(engine, checkpoint_dir: str) -> int:
    """Restore model, optimizer and LR schedule from a checkpoint written by
    :func:`save_training_state`; returns the optimizer step to continue from (the data position
    follows from it, see ``pipeline/train/data.py``).

    With the worker count of the run that saved it, the DeepSpeed checkpoint loads as it is. With
    another worker count a ZeRO checkpoint's optimizer partitions do not fit, so it is first
    converted to DeepSpeed's Universal Checkpoint format (see :func:`_universal_checkpoint_dir`)
    and loaded from there: the trained parameters (from their fp32 master copies), AdamW's moments
    and step, the optimizer's param-group settings and the LR scheduler state are all restored.

    Raises:
        FileNotFoundError: the directory is not a training checkpoint.
        IncompleteCheckpointError: its ``train_state.json`` is cut off or malformed (named).
        RuntimeError: resuming with another worker count and the universal conversion failed.
    """
    import ray.train

    state_file = os.path.join(checkpoint_dir, "train_state.json")
    if not os.path.isfile(state_file):
        raise FileNotFoundError(f"no train_state.json in {checkpoint_dir}: not a training checkpoint")
    with open(state_file, "rb") as fh:
        state = parse_train_state(fh.read(), state_file)
    world = ray.train.get_context().get_world_size()
    kwargs = dict(tag="state", load_optimizer_states=True, load_lr_scheduler_states=True)
    if state["world_size"] == world or not engine.zero_optimization():
        path, _ = engine.load_checkpoint(os.path.join(checkpoint_dir, "deepspeed"), **kwargs)
    else:
        path = _load_universal(engine, checkpoint_dir, kwargs)
    if path is None:
        raise FileNotFoundError(f"DeepSpeed state missing under {checkpoint_dir}/deepspeed")
    logger.info("resumed at step %d (saved with %d workers, now %d)", state["step"],
                state["world_size"], world)
    return int(state["step"])


def _load_universal(engine, checkpoint_dir: str, load_kwargs: dict) -> str | None:
    """Load the checkpoint's DeepSpeed state through a universal conversion (all workers call
    this together); returns ``engine.load_checkpoint``'s load path."""
    import torch.distributed as dist

    load_dir, own_tmp = _universal_checkpoint_dir(checkpoint_dir, load_kwargs["tag"])
    # DeepSpeed 0.19 reads this config field (the "checkpoint": {"load_universal": true} key) on
    # every load_checkpoint call; set it for this load only so later loads stay the regular kind
    cfg = engine._config
    previous = cfg.load_universal_checkpoint
    cfg.load_universal_checkpoint = True
    try:
        path, _ = engine.load_checkpoint(load_dir, **load_kwargs)
    finally:
        cfg.load_universal_checkpoint = previous
        dist.barrier()  # the node's converted copy is read by all its workers before it goes
        if own_tmp is not None:
            shutil.rmtree(own_tmp, ignore_errors=True)
    return path


def _universal_checkpoint_dir(checkpoint_dir: str, tag: str) -> tuple[str, str | None]:
    """Convert the ZeRO checkpoint under ``checkpoint_dir/deepspeed/<tag>`` to DeepSpeed's Universal
    Checkpoint format (``deepspeed.checkpoint.ds_to_universal``), which can be loaded at any data
    parallel world size. The first worker of each node converts into a temporary directory that
    the node's other workers then read; returns ``(load_dir, own_tmp)``: the directory to pass to
    ``engine.load_checkpoint`` and the temporary directory this worker must delete afterwards
    (None on the workers that did not convert).

    Raises:
        RuntimeError: the conversion failed on some node (raised on every worker, so none is left
            waiting for the others).
    """
    import ray.train
    import torch.distributed as dist

    ctx = ray.train.get_context()
    own_tmp, error = None, None
    if ctx.get_local_rank() == 0:
        own_tmp = tempfile.mkdtemp(prefix="ds_universal_")
        try:
            from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

            # single-process conversion (no process pools inside a Ray worker); our model has no
            # universal_checkpoint_info attribute, so let the converter inject the default one
            ds_to_universal(Namespace(
                input_folder=os.path.join(checkpoint_dir, "deepspeed", tag),
                output_folder=os.path.join(own_tmp, tag), num_extract_workers=1,
                num_merge_workers=1, keep_temp_folder=False, strict=True,
                inject_missing_state=True))
        except Exception as e:  # reported to every worker below
            logger.exception("universal checkpoint conversion of %s failed", checkpoint_dir)
            error = f"{type(e).__name__}: {e}"
    # exchanging the results also keeps every worker waiting until the conversions are done
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, (ctx.get_node_rank(), own_tmp, error))
    errors = [err for _, _, err in results if err]
    if errors:
        if own_tmp is not None:
            shutil.rmtree(own_tmp, ignore_errors=True)
        raise RuntimeError(f"converting the DeepSpeed state in {checkpoint_dir} to a universal "
                           f"checkpoint failed: {errors[0]}")
    node = ctx.get_node_rank()
    load_dir = next(path for n, path, _ in results if n == node and path is not None)
    return load_dir, own_tmp
