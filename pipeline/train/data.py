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
the cached hidden states travel). Because a worker knows every row id it will read
(:func:`worker_plan`), :meth:`CacheRowReader.prefetch` reads the row groups of the next
micro-batches in background threads (files kept open, rows decoded from the Arrow buffers) and
hands the micro-batches back in plan order: prefetching changes when rows are read, never which
rows a step sees or in what order.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from .. import storage
from ..cache.format import BYTE_COLUMNS, CorruptShardError, check_schema, decode_columns


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
        CorruptShardError: a shard's Parquet footer disagrees with the manifest's row count, or
            its columns with the cache schema (:func:`pipeline.cache.format.check_schema`).
        FileNotFoundError: a listed shard is missing.
    """

    def __init__(self, cache_dir: str, manifest: dict, split: str, storage_options: dict):
        import pyarrow.parquet as pq

        self.fs, base = storage.get_arrow_fs(storage.join(cache_dir, split), storage_options)
        self.groups: list[RowGroupRef] = []
        self.metadata: dict[str, object] = {}  # path -> pyarrow FileMetaData (footer read once)
        for shard in manifest["splits"][split]["shards"]:
            if not shard["rows"]:
                continue
            path = f"{base}/{shard['file']}"
            with self.fs.open_input_file(path) as fh:
                meta = pq.ParquetFile(fh).metadata
            check_schema(meta.schema.to_arrow_schema(), path)
            if meta.num_rows != shard["rows"]:
                raise CorruptShardError(f"cache shard {path} has {meta.num_rows} rows, the "
                                        f"manifest says {shard['rows']}")
            self.metadata[path] = meta
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


READ_COLUMNS = ("sample_id", "num_tokens", *BYTE_COLUMNS)


class ArrowRowGroup:
    """One row group's columns as numpy views into its Arrow buffers (no per-row Python
    objects): a binary column may come back in several chunks (over 2 GiB of bytes), each kept as
    (offsets int64 [n + 1], data uint8 [bytes]).

    Args:
        table: the row group, with at least :data:`READ_COLUMNS`.
    """

    def __init__(self, table):
        self.table = table  # keeps the buffers the views point into alive
        self.num_rows = table.num_rows
        self.sample_ids = table.column("sample_id").to_pylist()
        self.num_tokens = table.column("num_tokens").to_numpy().astype(np.int64)
        self.columns: dict[str, tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]] = {}
        for name in BYTE_COLUMNS:
            starts, chunks = [0], []
            for chunk in table.column(name).chunks:
                _, offsets, data = chunk.buffers()
                off = np.frombuffer(offsets, dtype=np.int32, count=len(chunk) + 1,
                                    offset=4 * chunk.offset).astype(np.int64)
                chunks.append((off, np.frombuffer(data, dtype=np.uint8) if data is not None
                               else np.zeros(0, dtype=np.uint8)))
                starts.append(starts[-1] + len(chunk))
            self.columns[name] = (np.asarray(starts, dtype=np.int64), chunks)

    def column_bytes(self, name: str, i: int) -> np.ndarray:
        """Row ``i``'s bytes of binary column ``name``: uint8 view [bytes] (read-only)."""
        starts, chunks = self.columns[name]
        c = int(np.searchsorted(starts, i, side="right") - 1)
        off, data = chunks[c]
        j = i - int(starts[c])
        return data[off[j]:off[j + 1]]

    def decode(self, i: int, hidden_size: int, num_context_layers: int) -> dict:
        """Row ``i`` decoded by :func:`pipeline.cache.format.decode_columns` (fresh tensors).

        Raises:
            CorruptShardError: byte sizes disagree with ``num_tokens`` (sample named).
        """
        cols = {c: self.column_bytes(c, i) for c in BYTE_COLUMNS}
        return decode_columns(self.sample_ids[i], int(self.num_tokens[i]), cols, hidden_size,
                              num_context_layers)


class CacheRowReader:
    """Reads rows by global id: row groups are read by a pool of I/O threads (each keeps its
    recently used shard files open, with the footers read once by the index), the last
    ``cached_groups`` of them stay in memory, and rows are decoded straight from the Arrow
    buffers.

    Use :meth:`read` for one micro-batch now, or :meth:`prefetch` to stream a known plan of
    micro-batches with ``depth`` of them read ahead. Close the reader (or use it as a context
    manager) to stop its threads.

    Args:
        index: a :class:`CacheRowIndex`.
        hidden_size, num_context_layers: to decode rows
        (:func:`pipeline.cache.format.decode_columns`). cached_groups: how many row groups (Arrow
        tables) to keep (LRU); at least the epoch
            order's shuffle window (4) so that every row group is read once per epoch.
        io_threads: row groups read concurrently (I/O and decompression release the GIL).
        open_files: shard files each I/O thread keeps open (LRU).
    """

    def __init__(self, index: CacheRowIndex, hidden_size: int, num_context_layers: int,
                 cached_groups: int = 8, io_threads: int = 4, open_files: int = 16):
        self.index = index
        self.hidden, self.m = hidden_size, num_context_layers
        self.cached_groups, self.open_files = cached_groups, open_files
        self._groups: OrderedDict[int, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._local = threading.local()
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="cache-io")
        self._decoder = ThreadPoolExecutor(1, thread_name_prefix="cache-decode")
        self.groups_read = 0  # row group reads so far (a re-read after eviction counts again)

    def __enter__(self) -> "CacheRowReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the threads (pending reads are cancelled); the reader is unusable afterwards."""
        self._decoder.shutdown(wait=True, cancel_futures=True)
        self._io.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._groups.clear()

    def _parquet_file(self, path: str):
        """This thread's open ``pq.ParquetFile`` of ``path`` (footer from the index)."""
        import pyarrow.parquet as pq

        files = getattr(self._local, "files", None)
        if files is None:
            files = self._local.files = OrderedDict()
        if path in files:
            files.move_to_end(path)
            return files[path][1]
        handle = self.index.fs.open_input_file(path)
        files[path] = (handle, pq.ParquetFile(handle, metadata=self.index.metadata[path],
                                              pre_buffer=True))
        while len(files) > self.open_files:
            old, _ = files.popitem(last=False)[1]
            old.close()
        return files[path][1]

    def _load_group(self, g: int) -> ArrowRowGroup:
        ref = self.index.groups[g]
        table = self._parquet_file(ref.path).read_row_group(ref.index, columns=list(READ_COLUMNS))
        if table.num_rows != ref.rows:
            raise CorruptShardError(f"cache shard {ref.path}: row group {ref.index} has "
                                    f"{table.num_rows} rows, its footer says {ref.rows}")
        return ArrowRowGroup(table)

    def _group(self, g: int) -> Future:
        """The (possibly still running) read of row group ``g``; starts it when not cached."""
        with self._lock:
            fut = self._groups.get(g)
            if fut is None:
                fut = self._groups[g] = self._io.submit(self._load_group, g)
                self.groups_read += 1
            self._groups.move_to_end(g)
            while len(self._groups) > self.cached_groups:  # in-flight users keep their future
                self._groups.popitem(last=False)
        return fut

    def _request(self, rows: list[int]) -> list[tuple[int, int, Future]]:
        """Start the reads of ``rows``' row groups: [(row id, row in group, group future)]."""
        out = []
        for row in rows:
            g, i = self.index.locate(int(row))
            out.append((int(row), i, self._group(g)))
        return out

    def _assemble(self, requested: list[tuple[int, int, Future]]) -> list[dict]:
        out = []
        for row, i, fut in requested:
            sample = fut.result().decode(i, self.hidden, self.m)
            sample["row_id"] = row
            out.append(sample)
        return out

    def read(self, rows: list[int]) -> list[dict]:
        """Decoded samples (see :func:`pipeline.cache.format.decode_columns`) of the given global
        row ids, in the given order, each with ``row_id``.

        Raises:
            CorruptShardError: a row's byte sizes are inconsistent (sample named).
            OSError / FileNotFoundError: a shard cannot be read.
        """
        return self._assemble(self._request(rows))

    def prefetch(self, batches: Iterable[list[int]], depth: int = 4
                 ) -> Iterator[tuple[list[int], list[dict]]]:
        """Stream ``(rows, samples)`` for each micro-batch of ``batches``, in that order, while
        the row groups of the next ``depth`` micro-batches are read and decoded in the
        background (``depth`` 0 reads each micro-batch when it is asked for).

        ``samples`` are exactly what :meth:`read` returns for ``rows``. An error reading a
        micro-batch is raised when that micro-batch is reached, not before. Closing the
        generator cancels what it has not handed out.
        """
        plan = iter(batches)
        pending: deque[tuple[list[int], Future]] = deque()

        def submit() -> bool:
            rows = next(plan, None)
            if rows is None:
                return False
            rows = [int(r) for r in rows]
            pending.append((rows, self._decoder.submit(self._assemble, self._request(rows))))
            return True

        try:
            while len(pending) <= depth and submit():
                pass
            while pending:
                rows, fut = pending.popleft()
                if depth:  # keep ``depth`` micro-batches in flight behind this one
                    submit()
                yield rows, fut.result()
                if not depth:
                    submit()
        finally:
            for _, fut in pending:
                fut.cancel()


def worker_plan(index: CacheRowIndex, seed: int, start_step: int, end_step: int,
                steps_per_epoch: int, global_batch_size: int, micro_batch_size: int, rank: int,
                world_size: int) -> Iterator[list[int]]:
    """Row ids of worker ``rank``'s micro-batches for optimizer steps [start_step, end_step), in
    training order: for each step, the micro-batches of :func:`worker_micro_batches` of its
    epoch's order (``index.epoch_order(seed, epoch)``). A resumed run's plan from step s is the
    tail of the uninterrupted run's plan.

    Raises:
        ValueError: the global batch does not split evenly into micro-batches over the workers.
    """
    epoch_cached, order = None, None
    for step in range(start_step, end_step):
        epoch, step_in_epoch = divmod(step, steps_per_epoch)
        if epoch != epoch_cached:
            epoch_cached, order = epoch, index.epoch_order(seed, epoch)
        yield from worker_micro_batches(order, step_in_epoch, global_batch_size,
                                        micro_batch_size, rank, world_size)


def subset_manifest(manifest: dict, max_rows: int | None, seed: int) -> dict:
    """The manifest with its training split cut to whole shards holding at least ``max_rows``
    rows (``train.max_train_rows``): shards taken in a seeded random order, so the subset for
    fewer rows is contained in the subset for more (nested data-scaling points), and listed in
    their original order. Row, token and supervised-token counts are recomputed; the held-out
    split and the draft-vocabulary statistics (token frequencies of the whole set) are kept.

    Args:
        manifest: the parsed ``manifest.json``.
        max_rows: rows wanted (None or >= all rows: the manifest unchanged).
        seed: the shard order's seed.
    Returns:
        A new manifest dict (the input is not modified).
    """
    train = manifest["splits"]["train"]
    if max_rows is None or max_rows >= train["rows"]:
        return manifest
    shards = train["shards"]
    order = np.random.default_rng([seed, 2024]).permutation(len(shards))
    keep, rows = set(), 0
    for i in order:
        if rows >= max_rows:
            break
        keep.add(int(i))
        rows += shards[i]["rows"]
    chosen = [s for i, s in enumerate(shards) if i in keep]
    cut = dict(train, shards=chosen, rows=sum(s["rows"] for s in chosen),
               tokens=sum(s.get("tokens", 0) for s in chosen),
               supervised_tokens=sum(s.get("supervised_tokens", 0) for s in chosen))
    return dict(manifest, splits=dict(manifest["splits"], train=cut))


def plateau_reached(history: list[dict], patience: int | None, min_delta: float) -> bool:
    """Whether held-out tau has stopped improving (``train.plateau_patience``): the last
    ``patience`` evaluations in ``history`` (entries with ``heldout_tau``) all stayed below the
    best one before them plus ``min_delta``. A pure function of the log, so every worker, and a
    resumed run, decides the same.

    Args:
        history: the training log, one dict per optimizer step.
        patience: evaluations without progress that end training (None: never).
        min_delta: the rise of held-out tau (tokens per round) that counts as progress.
    """
    if not patience:
        return False
    taus = [h["heldout_tau"] for h in history if "heldout_tau" in h]
    if len(taus) <= patience:
        return False
    best_before = max(taus[:-patience])
    return max(taus[-patience:]) < best_before + min_delta


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


HELDOUT_EPOCH = -1  # the epoch that seeds held-out rows' anchors (the same at every evaluation)


def row_generator(seed: int, epoch: int, row_id: int | str):
    """The anchor-sampling RNG of one row in one epoch (independent of which worker reads it)."""
    import torch

    digest = hashlib.blake2b(f"{seed}/{epoch}/{row_id}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)  # 63 bits
