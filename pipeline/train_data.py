"""Deterministic, resumable reading of the target cache for training (SPEC section 3: "resume
restores ... data position").

The order of rows is a pure function of (seed, epoch): row groups are permuted, then rows are
shuffled inside windows of a few row groups, so reads stay mostly sequential within Parquet row
groups. Global batch s of an epoch is rows [s*G, (s+1)*G) of that order and worker r of W takes
the r-th equal slice of it. Resuming at step s therefore reads exactly the rows an uninterrupted
run would have read, with any number of workers (the gradient is the mean over the global batch).
Anchor sampling is seeded per (seed, epoch, row), not per worker, for the same reason.

Ray Data's streaming split does not expose a resumable iterator position in open-source Ray, which
is why training reads the manifest's shards through pyarrow directly (still O(H) per token: only
the cached hidden states travel).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from . import storage
from .cache import CorruptShardError, decode_row


@dataclass(frozen=True)
class RowGroupRef:
    """One Parquet row group of the cache: file path (inside its filesystem), index, rows."""

    path: str
    index: int
    rows: int


class CacheRowIndex:
    """Global row ids over the manifest's shards of one split, row group by row group.

    Args:
        cache_dir: the cache root (local or s3://).
        manifest: the parsed ``manifest.json``.
        split: ``"train"`` or ``"heldout"``.
        storage_options: s3fs options.
    Raises:
        CorruptShardError: a shard's Parquet footer disagrees with the manifest's row count.
        FileNotFoundError: a listed shard is missing.
    """

    def __init__(self, cache_dir: str, manifest: dict, split: str, storage_options: dict):
        import pyarrow.parquet as pq

        self.fs, base = storage.get_arrow_fs(storage.join(cache_dir, split), storage_options)
        self.groups: list[RowGroupRef] = []
        for shard in manifest["splits"][split]["shards"]:
            if not shard["rows"]:
                continue
            path = f"{base}/{shard['file']}"
            with self.fs.open_input_file(path) as fh:
                meta = pq.ParquetFile(fh).metadata
            if meta.num_rows != shard["rows"]:
                raise CorruptShardError(f"cache shard {path} has {meta.num_rows} rows, the "
                                        f"manifest says {shard['rows']}")
            self.groups += [RowGroupRef(path, i, meta.row_group(i).num_rows)
                            for i in range(meta.num_row_groups)]
        sizes = np.array([g.rows for g in self.groups], dtype=np.int64)
        self.starts = np.concatenate(([0], np.cumsum(sizes)))
        self.num_rows = int(self.starts[-1])

    def epoch_order(self, seed: int, epoch: int, window: int = 4) -> np.ndarray:
        """Global row ids of one epoch: row groups permuted, rows shuffled within windows of
        ``window`` consecutive (permuted) row groups. int64 [num_rows]."""
        rng = np.random.default_rng([seed, epoch])
        perm = rng.permutation(len(self.groups))
        order = []
        for w in range(0, len(perm), window):
            rows = np.concatenate([np.arange(self.starts[g], self.starts[g + 1]) for g in perm[w:w + window]])
            order.append(rng.permutation(rows))
        return np.concatenate(order) if order else np.zeros(0, dtype=np.int64)

    def locate(self, row: int) -> tuple[int, int]:
        """(row group number, row inside it) of a global row id."""
        g = int(np.searchsorted(self.starts, row, side="right") - 1)
        return g, int(row - self.starts[g])


class CacheRowReader:
    """Reads rows by global id, keeping the last few row groups in memory.

    Args:
        index: a :class:`CacheRowIndex`.
        hidden_size, num_context_layers: to decode rows (:func:`pipeline.cache.decode_row`).
        cached_groups: how many decoded row groups to keep (LRU).
    """

    def __init__(self, index: CacheRowIndex, hidden_size: int, num_context_layers: int,
                 cached_groups: int = 8):
        self.index = index
        self.hidden, self.m = hidden_size, num_context_layers
        self.cached_groups = cached_groups
        self._groups: OrderedDict[int, list[dict]] = OrderedDict()

    def _group(self, g: int) -> list[dict]:
        import pyarrow.parquet as pq

        if g in self._groups:
            self._groups.move_to_end(g)
            return self._groups[g]
        ref = self.index.groups[g]
        with self.index.fs.open_input_file(ref.path) as fh:
            rows = pq.ParquetFile(fh).read_row_group(ref.index).to_pylist()
        self._groups[g] = rows
        while len(self._groups) > self.cached_groups:
            self._groups.popitem(last=False)
        return rows

    def read(self, rows: list[int]) -> list[dict]:
        """Decoded samples (see ``decode_row``) of the given global row ids, with ``row_id``.

        Raises:
            CorruptShardError: a row's byte sizes are inconsistent (sample named).
        """
        out = []
        for row in rows:
            g, i = self.index.locate(int(row))
            sample = decode_row(self._group(g)[i], self.hidden, self.m)
            sample["row_id"] = int(row)
            out.append(sample)
        return out


def steps_per_epoch(num_rows: int, global_batch_size: int) -> int:
    """Optimizer steps per epoch (the last partial global batch is dropped)."""
    return num_rows // global_batch_size


def worker_micro_batches(order: np.ndarray, step_in_epoch: int, global_batch_size: int,
                         micro_batch_size: int, rank: int, world_size: int) -> list[list[int]]:
    """Row ids of worker ``rank``'s micro-batches for one optimizer step.

    Raises:
        ValueError: the global batch does not split evenly into micro-batches over the workers.
    """
    per_worker = global_batch_size // world_size
    if per_worker * world_size != global_batch_size or per_worker % micro_batch_size:
        raise ValueError(f"global batch {global_batch_size} does not split into micro-batches of "
                         f"{micro_batch_size} over {world_size} workers")
    start = step_in_epoch * global_batch_size + rank * per_worker
    mine = order[start:start + per_worker].tolist()
    return [mine[i:i + micro_batch_size] for i in range(0, per_worker, micro_batch_size)]


def row_generator(seed: int, epoch: int, row_id: int):
    """The anchor-sampling RNG of one row in one epoch (independent of which worker reads it)."""
    import hashlib

    import torch

    digest = hashlib.blake2b(f"{seed}/{epoch}/{row_id}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)  # 63 bits
