"""Where a training worker's samples come from, one interface for every ``train.data_mode``:

- :class:`CachedRows` (offline, and hybrid after its first epoch): the Parquet cache, in the
  deterministic, resumable order of :mod:`pipeline.train.data`.
- :class:`StreamedRows` (online, and hybrid's first epoch): this worker's share of the Ray Data
  feature stream (:mod:`pipeline.feature_stream`), via ``ray.train.get_dataset_shard``.

Both hand out micro-batches as ``(keys, samples)``: ``samples`` decoded cache rows
(:func:`pipeline.cache.format.decode_columns`), ``keys`` one ``(epoch, row key)`` per sample that
seeds its anchor sampling (:func:`pipeline.train.data.row_generator`); and the held-out
micro-batches, the first ``train.eval_rows`` held-out samples in cache order, this worker's every
``world``-th of them.
"""

from __future__ import annotations

from typing import Iterator

from ..stream_state import STATE_FILE, StreamState, merged_state, read_state, worker_records
from .data import HELDOUT_EPOCH, ArrowRowGroup, CacheRowIndex, CacheRowReader, worker_plan

PREFETCH_MICRO_BATCHES = 4  # micro-batches each worker reads ahead of its training loop


class CachedRows:
    """The target cache at ``cache_dir`` (its ``manifest``)."""

    def __init__(self, cache_dir: str, manifest: dict, storage_options: dict, hidden: int,
                 num_context_layers: int, eval_rows: int | None, rank: int, world: int):
        self.index = CacheRowIndex(cache_dir, manifest, "train", storage_options)
        self.reader = CacheRowReader(self.index, hidden, num_context_layers)
        self.heldout_reader, self.heldout_rows = None, []
        if eval_rows and manifest["splits"].get("heldout", {}).get("rows"):
            h_index = CacheRowIndex(cache_dir, manifest, "heldout", storage_options)
            self.heldout_reader = CacheRowReader(h_index, hidden, num_context_layers)
            self.heldout_rows = list(range(min(h_index.num_rows, eval_rows)))[rank::world]
        self.rank, self.world = rank, world
        self._stream = None

    def micro_batches(self, start_step: int, end_step: int, steps_per_epoch: int, tc
                      ) -> Iterator[tuple[list[tuple[int, int]], list[dict]]]:
        """This worker's micro-batches of steps [start_step, end_step), read ahead in the
        background (:meth:`CacheRowReader.prefetch`)."""
        micro_per_step = tc.global_batch_size // self.world // tc.micro_batch_size
        self._stream = self.reader.prefetch(
            worker_plan(self.index, tc.seed, start_step, end_step, steps_per_epoch,
                        tc.global_batch_size, tc.micro_batch_size, self.rank, self.world),
            depth=PREFETCH_MICRO_BATCHES)
        for k, (rows, samples) in enumerate(self._stream):
            epoch = (start_step + k // micro_per_step) // steps_per_epoch
            yield [(epoch, r) for r in rows], samples

    def restore(self, checkpoint_dir: str) -> None:
        """Nothing to restore: the data position follows from the step."""

    def checkpoint_files(self) -> dict[str, str]:
        return {}

    def heldout_batches(self, micro_batch_size: int):
        for i in range(0, len(self.heldout_rows), micro_batch_size):
            rows = self.heldout_rows[i:i + micro_batch_size]
            yield [(HELDOUT_EPOCH, r) for r in rows], self.heldout_reader.read(rows)

    @property
    def has_heldout(self) -> bool:  # the same on every worker (some may hold no held-out row)
        return self.heldout_reader is not None

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self.reader.close()
        if self.heldout_reader is not None:
            self.heldout_reader.close()


class StreamedRows:
    """This worker's shards of the datasets ``train`` and (when evaluating) ``heldout`` that the
    driver handed ``TorchTrainer`` (:mod:`pipeline.feature_stream`). It records the
    ``(epoch, sample id)`` of every sample it hands to training (consumed); :meth:`checkpoint_files` merges
    every worker's records into the checkpoint's ``stream_state.json``
    (:mod:`pipeline.stream_state`), which the rebuilt stream of a restart leaves out.

    Raises (from :meth:`micro_batches`):
        RuntimeError: the stream ended before ``end_step`` (fewer rows than the schedule needs).
    """

    def __init__(self, hidden: int, num_context_layers: int, eval_rows: int | None, rank: int,
                 world: int, rows_per_epoch: int):
        import ray.train

        self.train = ray.train.get_dataset_shard("train")
        self.heldout = ray.train.get_dataset_shard("heldout") if eval_rows else None
        self.hidden, self.m = hidden, num_context_layers
        self.eval_rows, self.rank, self.world = eval_rows, rank, world
        self.state = StreamState(rows_per_epoch)  # rank 0: the merged record so far
        self.records: list[list[tuple[int, str]]] = []  # since the last checkpoint
        self._heldout_samples: list | None = None

    def restore(self, checkpoint_dir: str) -> None:
        """Continue the record of a restored checkpoint (local directory)."""
        self.state = read_state(checkpoint_dir, self.state.rows_per_epoch)

    def _decode(self, table) -> tuple[list[tuple[int, str]], list[dict]]:
        group = ArrowRowGroup(table)
        epochs = table.column("epoch").to_pylist()
        samples = [group.decode(i, self.hidden, self.m) for i in range(group.num_rows)]
        return list(zip(epochs, group.sample_ids)), samples

    def micro_batches(self, start_step: int, end_step: int, steps_per_epoch: int, tc
                      ) -> Iterator[tuple[list[tuple[int, str]], list[dict]]]:
        """Micro-batches of ``tc.micro_batch_size`` rows from the stream, each recorded as
        consumed when handed out."""
        needed = (end_step - start_step) * (tc.global_batch_size // self.world) \
            // tc.micro_batch_size
        if needed <= 0:  # nothing left to train: do not start the stream (its target actors)
            return
        batches = self.train.iter_batches(
            batch_size=tc.micro_batch_size, batch_format="pyarrow", drop_last=True,
            prefetch_batches=2, local_shuffle_buffer_size=tc.stream_shuffle_rows or None,
            local_shuffle_seed=None if not tc.stream_shuffle_rows else tc.seed + self.rank)
        for table in batches:
            if needed == 0:
                return
            keys, samples = self._decode(table)
            self.records.append(keys)
            yield keys, samples
            needed -= 1
        if needed:
            raise RuntimeError(f"the feature stream ended {needed} micro-batches before step "
                               f"{end_step} (too few rows for the schedule)")

    def checkpoint_files(self) -> dict[str, str]:
        """Gather every worker's records since the last checkpoint (all workers call it
        together); rank 0 returns ``{"stream_state.json": merged record}``, the others {}."""
        import torch.distributed as dist

        mine = worker_records(self.records)
        self.records = []
        gathered = [mine]
        if dist.is_available() and dist.is_initialized() and self.world > 1:
            gathered = [None] * self.world
            dist.all_gather_object(gathered, mine)
        if self.rank != 0:
            return {}
        self.state = merged_state(self.state, gathered)
        return {STATE_FILE: self.state.to_json()}

    def _load_heldout(self) -> list:
        import pyarrow as pa

        tables = list(self.heldout.iter_batches(batch_size=None, batch_format="pyarrow"))
        if not tables:
            return []
        table = pa.concat_tables(tables)
        # the offline path's held-out rows: the first samples in cache order, a conversation's
        # samples in their order (stable sort); keyed by that index, as the offline rows are
        convs = table.column("conversation").to_pylist()
        order = sorted(range(table.num_rows), key=lambda i: convs[i])[:self.eval_rows]
        mine = list(range(len(order)))[self.rank::self.world]
        if not mine:
            return []
        _, samples = self._decode(table.take([order[i] for i in mine]))
        return list(zip(mine, samples))

    def heldout_batches(self, micro_batch_size: int):
        if self._heldout_samples is None:
            self._heldout_samples = self._load_heldout() if self.heldout is not None else []
        rows = self._heldout_samples
        for i in range(0, len(rows), micro_batch_size):
            chunk = rows[i:i + micro_batch_size]
            yield [(HELDOUT_EPOCH, row) for row, _ in chunk], [s for _, s in chunk]

    @property
    def has_heldout(self) -> bool:
        return self.heldout is not None

    def close(self) -> None:
        pass
