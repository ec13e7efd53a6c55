"""Training checkpoints on storage: which are complete, and which one a run continues from.

Every training worker writes part of a checkpoint into its own temporary directory and hands it
to ``ray.train.report``, which uploads it into the checkpoint's directory on storage
(``<train.storage_path>/<run name>/checkpoint_<time>/``, local or s3://): rank 0 uploads
``train_state.json``, ``drafter/`` and DeepSpeed's ``deepspeed/latest``,
``deepspeed/state/mp_rank_00_model_states.pt`` and its ZeRO optimizer partition, every other rank
its own partition ``deepspeed/state/zero_pp_rank_<r>_mp_rank_00_optim_states.pt``. A worker killed
or failing mid-upload leaves a directory that a listing finds with some rank's files missing or
cut short. A re-run's ``resume_from: latest`` lists storage, and Ray Train's own registration is
no proof either: during a preemption Ray 2.60 commits a report from the surviving ranks alone.

So a checkpoint counts as complete only when its **completion marker** ``checkpoint_complete.json``
exists: rank 0 writes it (atomically: a local rename, or one S3 PUT) after a barrier that every rank
reaches only once its ``ray.train.report`` has returned, i.e. once its files are on storage. The
marker lists every file of every rank with its size in bytes; :func:`inspect_checkpoint` checks
that each is there with that size and that ``train_state.json`` parses. Checkpoints written before
markers existed (their ``train_state.json`` has no ``completion_marker`` key) are checked for what
their layout allows: ``train_state.json`` parses, the drafter and DeepSpeed model states exist,
and when any ZeRO partition exists, the partition of every rank up to ``world_size`` does (a file
cut short there is only caught when it is empty).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from . import storage

logger = logging.getLogger(__name__)

MARKER = "checkpoint_complete.json"
STATE = "train_state.json"
MARKER_FORMAT = "dspark-train-checkpoint/v1"
# rank 0's files in a checkpoint from before completion markers (the trainer has always
# saved the DeepSpeed state under the tag "state")
LEGACY_REQUIRED = ("drafter/config.json", "drafter/model.safetensors", "deepspeed/latest",
                   "deepspeed/state/mp_rank_00_model_states.pt")
_ZERO_PARTITION = re.compile(r"deepspeed/state/(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+"
                             r"_optim_states\.pt")


class IncompleteCheckpointError(ValueError):
    """A training checkpoint that some rank did not finish writing (the directory and what is
    missing or damaged in the message)."""


@dataclass(frozen=True)
class CheckpointStatus:
    """What :func:`inspect_checkpoint` found.

    Attributes:
        path: the checkpoint directory (a local path or s3:// URL).
        step: the optimizer step of ``train_state.json`` (None when it is missing or unreadable).
        problem: why the checkpoint cannot be resumed from, or None when it is complete.
        fit_id: the id of the ``run_train`` call that wrote it (None before fit ids).
    """

    path: str
    step: int | None
    problem: str | None
    fit_id: str | None = None  # the training run (one ``run_train`` call) that wrote it

    @property
    def complete(self) -> bool:
        return self.problem is None


def local_files(directory: str | Path) -> dict[str, int]:
    """Every file under ``directory``: {path relative to it, with "/" separators: size in bytes}."""
    root = Path(directory)
    return {p.relative_to(root).as_posix(): p.stat().st_size
            for p in sorted(root.rglob("*")) if p.is_file()}


def train_state_bytes(step: int, world_size: int, fit_id: str | None = None) -> bytes:
    """``train_state.json`` as rank 0 writes it: the optimizer step, the worker count, the
    marker that completes the checkpoint (its absence then means some rank did not finish) and
    the id of the ``run_train`` call that wrote it (its worker-group restarts continue from its
    own newest checkpoint, :func:`restore_choice`)."""
    return json.dumps({"step": step, "world_size": world_size, "completion_marker": MARKER,
                       **({"fit_id": fit_id} if fit_id else {})}).encode()


def marker_document(step: int, rank_files: list[dict[str, int]]) -> dict:
    """The completion marker's content.

    Args:
        step: the checkpoint's optimizer step.
        rank_files: per rank (index = world rank), {relative path: size in bytes} of the files it
            wrote (:func:`local_files` of its temporary checkpoint directory).
    """
    return {"format": MARKER_FORMAT, "step": step, "world_size": len(rank_files),
            "ranks": [dict(sorted(files.items())) for files in rank_files]}


def write_marker(checkpoint: str, step: int, rank_files: list[dict[str, int]],
                 storage_options: dict | None = None) -> None:
    """Mark ``checkpoint`` (a local directory or s3:// URL) complete. Call it only after every
    rank's files are on storage.

    Raises:
        OSError: the write failed (nothing is left at the marker's path).
    """
    storage.write_bytes_atomic(storage.join(checkpoint, MARKER),
                               json.dumps(marker_document(step, rank_files), indent=1).encode(),
                               storage_options)


def checkpoint_url(path: str, storage_path: str) -> str:
    """A checkpoint path as Ray Train's pyarrow filesystem names it (``bucket/key`` on S3) ->
    a local path or s3:// URL under ``storage_path``'s scheme."""
    if storage_path.startswith("s3://") and not path.startswith("s3://"):
        return "s3://" + path.lstrip("/")
    return path


def parse_train_state(data: bytes, where: str) -> dict:
    """``train_state.json``'s content: ``step`` and ``world_size`` (ints), ``completion_marker``
    (str) in checkpoints that have one.

    Raises:
        IncompleteCheckpointError: not JSON (e.g. cut off mid-upload) or fields missing, naming
            ``where``.
    """
    try:
        state = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise IncompleteCheckpointError(
            f"{where} is not valid JSON ({len(data)} bytes; cut off mid-upload?): {err}") from err
    if not (isinstance(state, dict) and isinstance(state.get("step"), int)
            and isinstance(state.get("world_size"), int)):
        raise IncompleteCheckpointError(f"{where} lacks integer step and world_size: {state!r}")
    return state


def _listing(fs, directory: str) -> dict[str, int]:
    """{path relative to ``directory``: size} of every file under it (empty when absent)."""
    prefix = fs._strip_protocol(directory).rstrip("/") + "/"  # how fs names what it lists
    found = fs.find(directory, detail=True) if fs.exists(directory) else {}
    return {name[len(prefix):]: int(info.get("size") or 0) for name, info in found.items()
            if info.get("type", "file") == "file" and name.startswith(prefix)}


def _status(files: dict[str, int], read, path: str) -> CheckpointStatus:
    """:class:`CheckpointStatus` of a checkpoint whose files are ``files``."""
    if STATE not in files:
        return CheckpointStatus(path, None, f"no {STATE} (rank 0 did not finish writing)")
    try:
        state = parse_train_state(read(STATE), storage.join(path, STATE))
    except IncompleteCheckpointError as err:
        return CheckpointStatus(path, None, str(err))
    step, problem = _problem(files, read, path, state)
    return CheckpointStatus(path, step, problem, state.get("fit_id"))


def _problem(files: dict[str, int], read, path: str, state: dict
             ) -> tuple[int | None, str | None]:
    """(step, problem) of a checkpoint whose files are ``files`` ({relative path: size}) and
    whose ``train_state.json`` says ``state``; ``read(relative path) -> bytes`` reads a file."""
    step = state["step"]
    if MARKER in files:
        try:
            marker = json.loads(read(MARKER))
            ranks = marker["ranks"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
            return step, f"{MARKER} is unreadable: {type(err).__name__}: {err}"
        if marker.get("step") != step:
            return step, f"{MARKER} is for step {marker.get('step')}, {STATE} for step {step}"
        for rank, expected in enumerate(ranks):
            for name, size in expected.items():
                if name not in files:
                    return step, f"rank {rank}'s {name} is missing"
                if files[name] != size:
                    return step, (f"rank {rank}'s {name} has {files[name]} bytes, {size} were "
                                  "written (cut off)")
        return step, None
    if state.get("completion_marker"):
        return step, (f"no {MARKER}: some rank did not finish writing or uploading its files "
                      "(the marker is written once all ranks have)")
    # before completion markers: what the layout allows
    for name in LEGACY_REQUIRED:
        if not files.get(name):
            return step, f"{name} is missing or empty (written before completion markers)"
    partitions = {int(m.group(1)): files[n] for n in files if (m := _ZERO_PARTITION.fullmatch(n))}
    if partitions:
        for rank in range(state["world_size"]):
            if not partitions.get(rank):
                return step, (f"rank {rank}'s ZeRO optimizer partition is missing or empty "
                              f"({state['world_size']} ranks wrote this checkpoint)")
    return step, None


def inspect_checkpoint(path: str, storage_options: dict | None = None) -> CheckpointStatus:
    """Whether the checkpoint directory ``path`` (local or s3://) is complete (module docstring).

    Never raises for a damaged checkpoint: the damage is the returned ``problem``.
    """
    fs = storage.get_fsspec(path, storage_options)
    files = _listing(fs, path)
    if not files:
        return CheckpointStatus(path, None, "no such checkpoint directory, or it is empty")

    def read(name: str) -> bytes:
        with fs.open(storage.join(path, name), "rb") as fh:
            return fh.read()

    return _status(files, read, path)


def scan_checkpoints(storage_path: str, run_name: str,
                     storage_options: dict | None = None) -> list[CheckpointStatus]:
    """Every ``checkpoint_*`` directory of run ``run_name`` under Ray Train's ``storage_path``
    (local, shared or s3://), inspected; in directory-name order (Ray Train names them by time).
    The run directory is listed once; only ``train_state.json`` and the marker are read."""
    fs = storage.get_fsspec(storage_path, storage_options)
    run_dir = storage.join(storage_path, run_name)
    per_checkpoint: dict[str, dict[str, int]] = {}
    for name, size in _listing(fs, run_dir).items():
        top, _, rest = name.partition("/")
        if top.startswith("checkpoint_") and rest:  # not Ray's checkpoint_manager_snapshot.json
            per_checkpoint.setdefault(top, {})[rest] = size
    out = []
    for top in sorted(per_checkpoint):
        path = storage.join(run_dir, top)

        def read(name: str, path=path) -> bytes:
            with fs.open(storage.join(path, name), "rb") as fh:
                return fh.read()

        out.append(_status(per_checkpoint[top], read, path))
    return out


def latest_checkpoint(storage_path: str, run_name: str,
                      storage_options: dict | None = None,
                      fit_id: str | None = None) -> str | None:
    """The complete checkpoint with the highest step of run ``run_name`` (ties: the one written
    last), or None; with ``fit_id``, among those that ``run_train`` call wrote. Every incomplete
    checkpoint found is logged as skipped, with the reason."""
    best: CheckpointStatus | None = None
    for status in scan_checkpoints(storage_path, run_name, storage_options):
        if fit_id is not None and status.fit_id != fit_id:
            continue
        if not status.complete:
            logger.warning("skipping checkpoint %s (step %s): %s", status.path,
                           "unknown" if status.step is None else status.step, status.problem)
        elif best is None or status.step >= best.step:
            best = status
    return best.path if best else None


def require_complete(path: str, storage_options: dict | None = None) -> int:
    """The step of checkpoint ``path`` (``train.resume_from`` given as a directory).

    Raises:
        IncompleteCheckpointError: naming ``path`` and what is missing or damaged.
    """
    status = inspect_checkpoint(path, storage_options)
    if not status.complete:
        raise IncompleteCheckpointError(f"train.resume_from {path} is not a complete training "
                                        f"checkpoint: {status.problem}")
    return status.step


def restore_choice(ray_checkpoint: str | None, resume_from: str | None, storage_path: str,
                   run_name: str, storage_options: dict | None = None,
                   fit_id: str | None = None) -> str | None:
    """The checkpoint a starting worker group continues from (None: step 0).

    A worker group restarted within one ``run_train`` call (``fit_id``) continues from that
    call's newest complete checkpoint; otherwise from ``resume_from``, what the driver chose
    (``latest`` resolved to the newest complete checkpoint, or a directory checked complete, or
    None for a fresh start, for which the driver removed the run's old checkpoints). What Ray
    Train hands the workers is not used: it may be a checkpoint some rank did not finish, it may
    not yet have registered one a worker wrote just before dying (measured: a worker killed right
    after a checkpoint's marker restarted the run at step 0), and on a re-run it overrides an
    explicit ``resume_from``. ``pipeline.feature_stream.Checkpoints`` makes this same choice, so
    the feature stream and the workers agree.

    Args:
        ray_checkpoint: Ray Train's checkpoint as a local path or s3:// URL, or None: only
            compared, and a difference logged.
        fit_id: the id of this ``run_train`` call (None: not used).
    """
    choice = resume_from
    if fit_id is not None:
        choice = latest_checkpoint(storage_path, run_name, storage_options,
                                   fit_id=fit_id) or resume_from
    if ray_checkpoint is not None and (
            choice is None or os.path.normpath(choice) != os.path.normpath(ray_checkpoint)):
        logger.warning("Ray Train restored %s; continuing from %s instead", ray_checkpoint,
                       choice or "step 0")
    return choice
