"""Writing target-cache shards (:mod:`pipeline.cache.format`): cache rows to Arrow, row groups cut
by rows and bytes, a shard streamed to local disk or S3 row group by row group, its sidecar, and
the supervised-token counts a sidecar carries.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pyarrow.parquet as pq

from .. import storage
from .format import BYTE_COLUMNS, SCHEMA, bf16_array
from ..config import DEFAULT_ROW_GROUP_BYTES, MAX_COLUMN_BYTES


# Row groups are cut by bytes as well as rows. A row group's byte column is built as one Arrow
# ``binary`` array, whose int32 offsets address at most 2 GiB: at Qwen3-8B shapes (H 4096, 5
# context layers, cache.max_length 4096) one row is 192 MiB and 16 of them hold 2.5 GiB of
# context_hidden ("ArrowInvalid: Negative offsets in binary array"). One row's value must also
# fit a Parquet page, whose size is an int32; the margin below 2 GiB covers zstd's worst-case
# growth of incompressible bytes (1/256) and the page header. Keeping ``binary`` (rather than
# ``large_binary``) leaves the schema, and so every cache already written, unchanged; a training
# worker holds a few row groups in memory (pipeline/train/data.py), which the byte cap bounds too.
# The limits (MAX_COLUMN_BYTES, DEFAULT_ROW_GROUP_BYTES) are defined with the config's fields.


def row_group_sizes(row_bytes, max_rows: int, max_bytes: int) -> list[int]:
    """Cut consecutive rows into row groups: each at most ``max_rows`` rows and ``max_bytes``
    bytes, except that a row larger than ``max_bytes`` makes a row group of its own.

    Args:
        row_bytes: each row's size in bytes, in row order (any int sequence).
        max_rows: ``cache.rows_per_row_group``.
        max_bytes: ``cache.row_group_bytes``.
    Returns:
        Rows per row group, in order (sums to ``len(row_bytes)``; [] for no rows).
    """
    sizes: list[int] = []
    rows = used = 0
    for b in row_bytes:
        b = int(b)
        if rows and (rows == max_rows or used + b > max_bytes):
            sizes.append(rows)
            rows = used = 0
        rows, used = rows + 1, used + b
    if rows:
        sizes.append(rows)
    return sizes


def check_row_size(max_length: int, hidden_size: int, num_context_layers: int) -> None:
    """Check that a sample of ``max_length`` tokens fits one cache row: its largest value,
    ``context_hidden`` (bf16 [T, m*H]), must stay within :data:`MAX_COLUMN_BYTES`.

    Raises:
        ValueError: with the sizes and what to lower.
    """
    largest = max_length * num_context_layers * hidden_size * 2
    if largest > MAX_COLUMN_BYTES:
        raise ValueError(
            f"a {max_length}-token sample's context_hidden ({num_context_layers} layers x "
            f"{hidden_size} x 2 bytes per token) is {largest:,} bytes, over the "
            f"{MAX_COLUMN_BYTES:,} bytes one Arrow binary value and Parquet page can hold: lower "
            "cache.max_length or the number of context layers")


def table_row_bytes(table: pa.Table) -> np.ndarray:
    """Each row's bytes over the byte columns (:data:`BYTE_COLUMNS`) of a :data:`SCHEMA` table:
    int64 [rows]."""
    total = np.zeros(table.num_rows, dtype=np.int64)
    for name in BYTE_COLUMNS:
        total += pa.compute.binary_length(table.column(name)).to_numpy(
            zero_copy_only=False).astype(np.int64)
    return total


# Parquet layout of a shard. Every column is zstd-compressed, hidden states included: on real
# SmolLM2 activations (and the benchmark's synthetic ones) zstd stores bf16 hidden states in 0.80
# of their size, for ~0.8 CPU s/GB more when reading (benchmarks/results/cache_io/2026-12-01_unrecorded.md, which also
# has the uncompressed numbers): on an object store, where the cache is bandwidth-bound and the
# paper-scale cache is ~38 TB, the 20 % fewer bytes win. Only ``domain`` is dictionary-encoded:
# byte columns are unique per row, so a dictionary there is built, found useless and dropped (one
# measurement on SmolLM2 activations, uncompressed: 388 MB/s read with it, 3,482 MB/s without).
# Statistics only where a reader could filter on them.
PARQUET_OPTIONS = {"compression": "zstd", "use_dictionary": ["domain"],
                   "write_statistics": ["sample_id", "domain", "num_tokens"]}


class ShardWriter:
    """Streams one cache shard to ``<path>.parquet``: each :meth:`write_table` call becomes
    Parquet row groups right away, going out through a :class:`pipeline.storage.AtomicWriter` (a
    local temporary renamed on commit, or an S3 multipart upload completed on commit, in parts of
    the s3fs option ``default_block_size``, 50 MiB unless set), so a shard never sits whole in
    memory (at most a row group and an upload part do) and a partial one is never visible.
    :meth:`close` commits and returns the shard's statistics; leaving a ``with`` block on an
    exception discards the shard.

    Args:
        path: shard base path (local or s3://) without suffix.
        rows_per_row_group: the most rows in one row group.
        parquet_options: ``pq.ParquetWriter`` keywords (:data:`PARQUET_OPTIONS` by default).
        row_group_bytes: the most bytes (uncompressed, all byte columns) in one row group; a
            larger row goes alone (:func:`row_group_sizes`).
    Raises:
        ValueError: ``row_group_bytes`` over :data:`MAX_COLUMN_BYTES`.
        OSError: the store failed (nothing is left at the shard's path).
    """

    def __init__(self, path: str, storage_options: dict, rows_per_row_group: int,
                 parquet_options: dict | None = None,
                 row_group_bytes: int = DEFAULT_ROW_GROUP_BYTES):
        if row_group_bytes > MAX_COLUMN_BYTES:
            raise ValueError(f"row_group_bytes {row_group_bytes:,} is over the "
                             f"{MAX_COLUMN_BYTES:,} bytes of one Arrow binary column")
        self.file_name = path.rsplit("/", 1)[-1] + ".parquet"
        self.rows_per_row_group = rows_per_row_group
        self.row_group_bytes = row_group_bytes
        self._out = storage.AtomicWriter(path + ".parquet", storage_options)
        try:
            self._writer = pq.ParquetWriter(self._out, SCHEMA,
                                            **(parquet_options or PARQUET_OPTIONS))
        except BaseException:
            self._out.discard()
            raise
        self.rows = self.tokens = 0
        self._counts = np.zeros(0, dtype=np.int64)

    def write_table(self, table: pa.Table) -> None:
        """Append cache rows as row groups of at most ``rows_per_row_group`` rows and
        ``row_group_bytes`` bytes (:func:`row_group_sizes`).

        Args:
            table: columns of :data:`SCHEMA` (e.g. from :func:`rows_table`).
        Raises:
            ValueError: another schema.
            OSError: the store failed (raised here or by :meth:`close`).
        """
        if not table.schema.equals(SCHEMA, check_metadata=False):
            raise ValueError(f"cache rows with schema {table.schema}, expected {SCHEMA}")
        if not table.num_rows:
            return
        start = 0
        for n in row_group_sizes(table_row_bytes(table), self.rows_per_row_group,
                                 self.row_group_bytes):
            self._writer.write_table(table.slice(start, n), row_group_size=n)
            start += n
        ids = np.concatenate([_column_values(c, "<i4") for c in table.column("input_ids").chunks])
        mask = np.concatenate([_column_values(c, np.uint8)
                               for c in table.column("loss_mask").chunks]).astype(bool)
        c = np.bincount(ids[mask], minlength=self._counts.size)
        self._counts = np.pad(self._counts, (0, c.size - self._counts.size)) + c
        self.tokens += int(pa.compute.sum(table.column("num_tokens")).as_py())
        self.rows += table.num_rows

    def write_rows(self, records: list[dict]) -> None:
        """Append cache rows given as dicts (byte columns as ``bytes``); see :meth:`write_table`."""
        self.write_table(pa.Table.from_pylist(records, schema=SCHEMA))

    def close(self) -> dict:
        """Finish the file and make it visible.

        Returns:
            ``file``, ``rows``, ``tokens``, ``supervised_tokens``, ``supervised_token_counts``
            ({str(token id): count}), ``bytes`` and ``sha256`` of the stored file.
        Raises:
            OSError: the store failed (the shard is discarded).
        """
        try:
            self._writer.close()
        except BaseException:
            self._out.discard()
            raise
        self._out.commit()
        return {"file": self.file_name, "rows": self.rows, "tokens": self.tokens,
                "supervised_tokens": int(self._counts.sum()),
                "supervised_token_counts": token_counts_dict(self._counts),
                "bytes": self._out.bytes_written, "sha256": self._out.sha256.hexdigest()}

    def discard(self) -> None:
        """Drop the shard (nothing at its path, no temporary, an S3 upload aborted)."""
        self._writer.is_open = False  # pyarrow would write the footer when garbage-collected
        self._out.discard()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.discard()


def _column_values(chunk: pa.BinaryArray, dtype) -> np.ndarray:
    """All values of a binary column chunk, concatenated in row order, as ``dtype`` (a view
    into the Arrow buffer)."""
    _, offsets, data = chunk.buffers()
    off = np.frombuffer(offsets, dtype=np.int32, count=len(chunk) + 1, offset=4 * chunk.offset)
    if data is None or off[-1] == off[0]:
        return np.zeros(0, dtype=dtype)
    return np.frombuffer(data, dtype=np.uint8)[off[0]:off[-1]].view(dtype)


def binary_column(values: list[np.ndarray]) -> pa.BinaryArray:
    """A binary Arrow column from per-row byte arrays (any dtype, C-contiguous), copied once into
    one buffer (``pa.array`` of ``bytes`` would copy twice).

    Raises:
        ValueError: the values hold more than :data:`MAX_COLUMN_BYTES` bytes (cut the rows into
            smaller row groups: :func:`row_group_sizes`).
    """
    flat = [np.ascontiguousarray(v).reshape(-1).view(np.uint8) for v in values]
    # summed in int64: int32 offsets would wrap past 2 GiB into negative ones
    ends = np.cumsum([f.size for f in flat], dtype=np.int64)
    if ends.size and ends[-1] > MAX_COLUMN_BYTES:
        raise ValueError(f"{len(flat)} values of {int(ends[-1]):,} bytes in one binary column, "
                         f"over {MAX_COLUMN_BYTES:,}: cut them into smaller row groups")
    offsets = np.zeros(len(flat) + 1, dtype=np.int32)
    offsets[1:] = ends
    data = np.concatenate(flat) if flat else np.zeros(0, dtype=np.uint8)
    return pa.BinaryArray.from_buffers(pa.binary(), len(flat),
                                       [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def rows_table(samples: list[dict], context: list, last: list) -> pa.Table:
    """Cache rows as an Arrow table of :data:`SCHEMA`.

    Args:
        samples: ``sample_id``, ``domain``, ``input_ids`` and ``loss_mask`` (lists, [T]) each.
        context: per sample, [T, m*H] torch (any float dtype and device; stored as bf16) or
            numpy int16 bf16 bits.
        last: per sample, [T, H] likewise.
    """
    as_np = lambda t: t if isinstance(t, np.ndarray) else bf16_array(t)  # noqa: E731
    return pa.table({
        "sample_id": pa.array([s["sample_id"] for s in samples], pa.string()),
        "domain": pa.array([s["domain"] for s in samples], pa.string()),
        "num_tokens": pa.array([len(s["input_ids"]) for s in samples], pa.int32()),
        "input_ids": binary_column([np.asarray(s["input_ids"], dtype="<i4") for s in samples]),
        "loss_mask": binary_column([np.asarray(s["loss_mask"], dtype=np.uint8) for s in samples]),
        "context_hidden": binary_column([as_np(t) for t in context]),
        "last_hidden": binary_column([as_np(t) for t in last]),
    }, schema=SCHEMA)


def write_sidecar(path: str, summary: dict, storage_options: dict) -> None:
    """Write ``<path>.json``. Call it after the shard is committed: its presence marks the shard
    complete."""
    storage.write_bytes_atomic(path + ".json", json.dumps(summary).encode(), storage_options)


def read_sidecar(path: str, storage_options: dict) -> dict | None:
    """The sidecar ``<path>.json`` of a complete shard, or None when the shard is not complete."""
    if not storage.exists(path + ".json", storage_options):
        return None
    return json.loads(storage.read_bytes(path + ".json", storage_options))


def write_shard(path: str, records: list[dict], *, rows_per_row_group: int,
                storage_options: dict, extra: dict | None = None,
                parquet_options: dict | None = None,
                row_group_bytes: int = DEFAULT_ROW_GROUP_BYTES) -> dict:
    """Write one shard from rows held in memory (the streaming form is :class:`ShardWriter`):
    ``<path>.parquet``, then its ``<path>.json`` sidecar, which marks the shard complete.

    Args:
        path: shard base path (local or s3://) without suffix.
        records: cache rows (columns of :data:`SCHEMA`, byte columns as ``bytes``).
        rows_per_row_group, row_group_bytes: the most rows and bytes in one Parquet row group.
        extra: more sidecar fields (``fingerprint``, ``errors``).
    Returns:
        The sidecar (see :meth:`ShardWriter.close`, plus ``extra``).
    Raises:
        OSError: the store failed (nothing is left at the shard's path).
    """
    with ShardWriter(path, storage_options, rows_per_row_group, parquet_options,
                     row_group_bytes) as writer:
        start = 0
        for n in row_group_sizes([sum(len(r[c]) for c in BYTE_COLUMNS) for r in records],
                                 rows_per_row_group, row_group_bytes):
            writer.write_rows(records[start:start + n])
            start += n
        summary = {**writer.close(), **(extra or {})}
    write_sidecar(path, summary, storage_options)
    return summary


def supervised_token_counts(records: list[dict]) -> dict[str, int]:
    """How often each target token is a supervised (assistant) token in these cache rows:
    {str(token id): count}, the input of the draft vocabulary's frequency ranking."""
    return token_counts_dict(add_supervised_counts(np.zeros(0, dtype=np.int64), records))


def add_supervised_counts(counts: np.ndarray, records: list[dict]) -> np.ndarray:
    """``counts`` (int64 [V'], indexed by token id) plus the supervised tokens of ``records``
    (grown as needed)."""
    for r in records:
        ids = np.frombuffer(r["input_ids"], dtype="<i4")
        mask = np.frombuffer(r["loss_mask"], dtype=np.uint8).astype(bool)
        c = np.bincount(ids[mask], minlength=counts.size)
        counts = np.pad(counts, (0, c.size - counts.size)) + c
    return counts


def token_counts_dict(counts: np.ndarray) -> dict[str, int]:
    """{str(token id): count} of the non-zero entries of ``counts``."""
    return {str(t): int(counts[t]) for t in np.flatnonzero(counts)}
