"""Which streamed samples training has consumed (online and hybrid ``train.data_mode``), so that a
restart neither loses nor repeats any.

The feature stream's order is not deterministic (Ray Data hands blocks to whichever worker asks,
and each worker shuffles locally), so a resumed stream cannot be positioned by a step count.
Instead every worker records the ``(epoch, sample id)`` of each sample it consumes; at each
checkpoint the records of all workers are merged into ``stream_state.json`` inside the checkpoint.
A stream rebuilt from that checkpoint (``pipeline.feature_stream``) starts at the oldest epoch not
yet complete and leaves out every sample recorded there, so the samples of each epoch are trained
on exactly once across any number of restarts; samples that were read into a worker's buffers but
not trained on before the checkpoint come again.

Per epoch the state keeps ``seen`` (samples consumed, repeats included) and ``distinct``; the
ids only while the epoch is incomplete: the file holds the ids of the open epochs, ~40 bytes a
sample (a 1 M-sample epoch: ~40 MB rewritten at each checkpoint; a bitmap over the samples' index
in cache order would make it 125 KB, not done yet). A consumed sample is one handed to a training
step, also when that step was skipped for a non-finite loss (as the offline path moves past such
rows too). ``benchmarks/fault_matrix.py`` reads the counts to report lost and repeated samples.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from . import storage

STATE_FILE = "stream_state.json"


@dataclass
class StreamState:
    """Consumed samples per stream epoch.

    Attributes:
        rows_per_epoch: samples in one epoch of the stream (the split's scan).
        consumed: {epoch: sample ids trained on} of the epochs not complete.
        seen: {epoch: samples trained on, repeats included}.
        distinct: {epoch: distinct samples trained on}.
    """

    rows_per_epoch: int
    consumed: dict[int, set[str]] = field(default_factory=dict)
    seen: dict[int, int] = field(default_factory=dict)
    distinct: dict[int, int] = field(default_factory=dict)

    def add(self, epoch: int, sample_ids: list[str]) -> None:
        """Record samples of ``epoch`` as trained on (an epoch recorded complete ignores ids)."""
        self.seen[epoch] = self.seen.get(epoch, 0) + len(sample_ids)
        if self.complete(epoch):
            return
        ids = self.consumed.setdefault(epoch, set())
        ids.update(sample_ids)
        self.distinct[epoch] = len(ids)
        if len(ids) >= self.rows_per_epoch:  # complete: keep the counts, drop the ids
            del self.consumed[epoch]

    def complete(self, epoch: int) -> bool:
        return self.distinct.get(epoch, 0) >= self.rows_per_epoch and epoch not in self.consumed

    def first_open_epoch(self) -> int:
        """The oldest epoch with samples left: where a rebuilt stream starts."""
        open_ = sorted(self.consumed)
        if open_:
            return open_[0]
        done = [e for e in self.distinct if self.complete(e)]
        return max(done) + 1 if done else 0

    def to_json(self) -> str:
        return json.dumps({"rows_per_epoch": self.rows_per_epoch,
                           "epochs": {str(e): {"seen": self.seen.get(e, 0),
                                               "distinct": self.distinct.get(e, 0),
                                               **({"consumed": sorted(self.consumed[e])}
                                                  if e in self.consumed else {})}
                                      for e in sorted(self.seen)}})

    @classmethod
    def from_json(cls, text: str) -> "StreamState":
        doc = json.loads(text)
        state = cls(int(doc["rows_per_epoch"]))
        for key, e in doc["epochs"].items():
            epoch = int(key)
            state.seen[epoch] = int(e["seen"])
            state.distinct[epoch] = int(e["distinct"])
            if "consumed" in e:
                state.consumed[epoch] = set(e["consumed"])
        return state


def worker_records(keys_by_step: list[list[tuple[int, str]]]) -> dict[int, list[str]]:
    """{epoch: sample ids} of a worker's trained ``(epoch, sample id)`` keys."""
    out: dict[int, list[str]] = {}
    for keys in keys_by_step:
        for epoch, sample_id in keys:
            out.setdefault(int(epoch), []).append(str(sample_id))
    return out


def merged_state(base: StreamState, per_worker: list[dict[int, list[str]]]) -> StreamState:
    """``base`` (the state restored from the checkpoint) plus every worker's records since."""
    for records in per_worker:
        for epoch, ids in records.items():
            base.add(epoch, ids)
    return base


class StreamRecordError(ValueError):
    """A checkpoint that a feature stream should continue from has no usable record."""


def read_state(checkpoint: str | None, rows_per_epoch: int,
               storage_options: dict | None = None, require: bool = False) -> StreamState:
    """The stream state saved in a checkpoint directory (local or s3://); an empty one for None,
    or for a checkpoint without it unless ``require``.

    Raises:
        StreamRecordError: ``require`` and the checkpoint has no record (written by the cache
            path or before records existed: the stream would start over while the workers go
            on), or its epoch size is not ``rows_per_epoch`` (the data changed since).
    """
    if checkpoint is None:
        return StreamState(rows_per_epoch)
    path = storage.join(checkpoint, STATE_FILE)
    if not storage.exists(path, storage_options):
        if require:
            raise StreamRecordError(
                f"{checkpoint} has no {STATE_FILE}: it was not written by streamed training, so "
                "a stream cannot continue from it; resume it with train.data_mode offline, or "
                "start over (train.resume_from: null)")
        return StreamState(rows_per_epoch)
    state = StreamState.from_json(storage.read_bytes(path, storage_options).decode())
    if state.rows_per_epoch != rows_per_epoch:
        raise StreamRecordError(
            f"{path} counts {state.rows_per_epoch} samples an epoch, the generate output now "
            f"makes {rows_per_epoch}: the data changed since that checkpoint; start over "
            "(train.resume_from: null)")
    return state
