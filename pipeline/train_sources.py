"""Where a training worker's samples come from, one interface for every ``train.data_mode``:

- :class:`CachedRows` (offline, and hybrid after its first epoch): the Parquet cache, in the
  deterministic, resumable order of :mod:`pipeline.train_data`.
- :class:`StreamedRows` (online, and hybrid's first epoch): this worker's share of the Ray Data
  feature stream (:mod:`pipeline.feature_stream`), via ``ray.train.get_dataset_shard``.

Both hand out micro-batches as ``(keys, samples)``: ``samples`` decoded cache rows
(:func:`pipeline.cache_format.decode_columns`), ``keys`` one ``(epoch, row key)`` per sample that
seeds its anchor sampling (:func:`pipeline.train_data.row_generator`); and the held-out
micro-batches, the first ``train.eval_rows`` held-out samples in id order, this worker's every
``world``-th of them.
"""

from __future__ import annotations

import logging
from typing import Iterator

from .train_data import ArrowRowGroup, CacheRowIndex, CacheRowReader, worker_plan

logger = logging.getLogger(__name__)
PREFETCH_MICRO_BATCHES = 4  # micro-batches each worker reads ahead of its training loop
HELDOUT_EPOCH = -1  # the epoch that seeds held-out anchors


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
    driver handed ``TorchTrainer`` (:mod:`pipeline.feature_stream`).

    Raises (from :meth:`micro_batches`):
        RuntimeError: the stream ended before ``end_step`` (fewer rows than the schedule needs).
    """

    def __init__(self, hidden: int, num_context_layers: int, eval_rows: int | None, rank: int,
                 world: int):
        import ray.train

        self.train = ray.train.get_dataset_shard("train")
        self.heldout = ray.train.get_dataset_shard("heldout") if eval_rows else None
        self.hidden, self.m = hidden, num_context_layers
        self.eval_rows, self.rank, self.world = eval_rows, rank, world
        self._heldout_samples: list | None = None

    def _decode(self, table) -> tuple[list[tuple[int, str]], list[dict]]:
        group = ArrowRowGroup(table)
        epochs = table.column("epoch").to_pylist()
        samples = [group.decode(i, self.hidden, self.m) for i in range(group.num_rows)]
        return list(zip(epochs, group.sample_ids)), samples

    def micro_batches(self, start_step: int, end_step: int, steps_per_epoch: int, tc
                      ) -> Iterator[tuple[list[tuple[int, str]], list[dict]]]:
        """Micro-batches of ``tc.micro_batch_size`` rows from the stream. A stream built for an
        earlier step than ``start_step`` (a restart that found no newer checkpoint than the one
        the stream was built for cannot; an explicit ``resume_from`` older than the newest
        checkpoint can) is advanced by the rows of the steps between."""
        per_worker_step = tc.global_batch_size // self.world
        batches = self.train.iter_batches(
            batch_size=tc.micro_batch_size, batch_format="pyarrow", drop_last=True,
            prefetch_batches=2, local_shuffle_buffer_size=tc.stream_shuffle_rows or None,
            local_shuffle_seed=None if not tc.stream_shuffle_rows else tc.seed + self.rank)
        skip, needed = None, (end_step - start_step) * per_worker_step // tc.micro_batch_size
        for table in batches:
            if skip is None:
                built_for = int(table.column("start_step")[0].as_py())
                skip = max(0, start_step - built_for) * per_worker_step // tc.micro_batch_size
                if built_for > start_step:
                    logger.warning("the feature stream starts at step %d, the workers at %d: "
                                   "the steps between see later samples", built_for, start_step)
            if skip:
                skip -= 1
                continue
            yield self._decode(table)
            needed -= 1
            if needed == 0:
                return
        raise RuntimeError(f"the feature stream ended {needed} micro-batches before step "
                           f"{end_step} (too few rows for the schedule)")

    def _load_heldout(self) -> list:
        import pyarrow as pa

        tables = list(self.heldout.iter_batches(batch_size=None, batch_format="pyarrow"))
        if not tables:
            return []
        table = pa.concat_tables(tables)
        # the offline path's held-out rows: the first samples in conversation (id) order; a
        # conversation's samples keep their order (stable sort)
        order = sorted(range(table.num_rows),
                       key=lambda i: table.column("conversation")[i].as_py())
        mine = order[:self.eval_rows][self.rank::self.world]
        return list(zip(*self._decode(table.take(mine)))) if mine else []

    def heldout_batches(self, micro_batch_size: int):
        if self._heldout_samples is None:
            self._heldout_samples = self._load_heldout() if self.heldout is not None else []
        rows = self._heldout_samples
        for i in range(0, len(rows), micro_batch_size):
            chunk = rows[i:i + micro_batch_size]
            yield [(HELDOUT_EPOCH, key) for (_, key), _ in chunk], [s for _, s in chunk]

    @property
    def has_heldout(self) -> bool:
        return self.heldout is not None

    def close(self) -> None:
        pass
