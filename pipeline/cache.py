"""Cache stage: one target forward per sample (samples of similar length batched together),
written as the target cache of SPEC 1.4.

Layout of ``<output>/<split>/``: ``shard-NNNNN.parquet`` files plus a ``shard-NNNNN.json`` sidecar
written after the shard (its presence marks the shard complete), and ``<output>/manifest.json``.
Shards are deterministic slices of the id-sorted conversations, so a re-run writes only missing
shards. Each worker writes its own shards, streaming them row group by row group (a local
temporary renamed when complete, or an S3 multipart upload completed when complete); nothing
V-sized or cache-sized passes the driver.

Columns (hidden states as raw little-endian bytes plus explicit sizes, readable by any Parquet
reader): ``sample_id`` string, ``domain`` string, ``num_tokens`` int32, ``input_ids`` binary
(int32 [T]), ``loss_mask`` binary (uint8 [T]), ``context_hidden`` binary (bf16 [T, m*H], layers
concatenated in ascending order), ``last_hidden`` binary (bf16 [T, H], the LM head's input).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pyarrow.parquet as pq

from . import storage
from .config import DEFAULT_FORWARD_BATCH_TOKENS, DEFAULT_ROW_GROUP_BYTES, MAX_COLUMN_BYTES
from .plan import bytes_per_token

logger = logging.getLogger(__name__)

CACHE_FORMAT = "dspark-target-cache/v1"
SCHEMA = pa.schema([
    ("sample_id", pa.string()), ("domain", pa.string()), ("num_tokens", pa.int32()),
    ("input_ids", pa.binary()), ("loss_mask", pa.binary()),
    ("context_hidden", pa.binary()), ("last_hidden", pa.binary()),
])


class CorruptShardError(ValueError):
    """A cache row or shard does not match its manifest (sizes, hash or schema)."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def bf16_array(t) -> np.ndarray:
    """A torch tensor's bf16 bits as a CPU numpy int16 array (numpy has no bf16), same shape."""
    import torch

    return t.to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy()


def decode_row(row: dict, hidden_size: int, num_context_layers: int) -> dict:
    """Decode one cache row (a dict of Python values, e.g. from ``Table.to_pylist()``).

    Returns:
        ``input_ids`` int64 [T], ``loss_mask`` uint8 [T], ``context_hidden`` bf16 [T, m*H],
        ``last_hidden`` bf16 [T, H], ``sample_id`` str.
    Raises:
        CorruptShardError: byte sizes disagree with ``num_tokens`` (naming the sample).
    """
    cols = {c: np.frombuffer(row[c], dtype=np.uint8) for c in BYTE_COLUMNS}
    return decode_columns(row.get("sample_id"), int(row["num_tokens"]), cols, hidden_size,
                          num_context_layers)


BYTE_COLUMNS = ("input_ids", "loss_mask", "context_hidden", "last_hidden")


def decode_columns(sample_id: str | None, num_tokens: int, cols: dict[str, np.ndarray],
                   hidden_size: int, num_context_layers: int) -> dict:
    """Decode one cache row from its byte columns, given as uint8 numpy views (e.g. straight into
    an Arrow buffer; each is copied once into a fresh, writable tensor).

    Args:
        sample_id: the row's ``sample_id`` (named in errors).
        num_tokens: T.
        cols: ``input_ids`` [4T], ``loss_mask`` [T], ``context_hidden`` [2*T*m*H],
            ``last_hidden`` [2*T*H], all uint8, little-endian payloads of SPEC 1.4.
    Returns:
        ``input_ids`` int64 [T], ``loss_mask`` uint8 [T], ``context_hidden`` bf16 [T, m*H],
        ``last_hidden`` bf16 [T, H], ``sample_id`` str.
    Raises:
        CorruptShardError: byte sizes disagree with ``num_tokens`` (naming the sample).
    """
    import torch

    t, w = num_tokens, num_context_layers * hidden_size
    sizes = {"input_ids": 4 * t, "loss_mask": t, "context_hidden": 2 * t * w,
             "last_hidden": 2 * t * hidden_size}
    for col, size in sizes.items():
        if cols[col].size != size:
            raise CorruptShardError(f"cache row {sample_id!r}: column {col} has {cols[col].size} "
                                    f"bytes, expected {size} for {t} tokens")
    def as_bf16(b: np.ndarray, width: int):  # [T, width] bf16, a fresh writable tensor
        return torch.from_numpy(b.view("<i2").copy()).view(torch.bfloat16).view(t, width)

    return {
        "sample_id": sample_id,
        "input_ids": torch.from_numpy(cols["input_ids"].view("<i4").astype(np.int64)),
        "loss_mask": torch.from_numpy(cols["loss_mask"].copy()),
        "context_hidden": as_bf16(cols["context_hidden"], w),
        "last_hidden": as_bf16(cols["last_hidden"], hidden_size),
    }


# Row groups are cut by bytes as well as rows. A row group's byte column is built as one Arrow
# ``binary`` array, whose int32 offsets address at most 2 GiB: at Qwen3-8B shapes (H 4096, 5
# context layers, cache.max_length 4096) one row is 192 MiB and 16 of them hold 2.5 GiB of
# context_hidden ("ArrowInvalid: Negative offsets in binary array"). One row's value must also
# fit a Parquet page, whose size is an int32; the margin below 2 GiB covers zstd's worst-case
# growth of incompressible bytes (1/256) and the page header. Keeping ``binary`` (rather than
# ``large_binary``) leaves the schema, and so every cache already written, unchanged; a training
# worker holds a few row groups in memory (pipeline/train_data.py), which the byte cap bounds too.
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
# of their size, for ~0.8 CPU s/GB more when reading (benchmarks/results/cache_io.md, which also
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


class CacheWriterUDF:
    """Ray Data callable class: tokenizes conversations, runs the target, writes one shard per
    input row. Input columns: ``shard`` (int), ``path`` (shard base path without suffix),
    ``fingerprint`` and ``rows`` (JSON list of conversations). Output: one summary row per shard.

    A shard's samples go to the target a row group at a time (at most ``rows_per_row_group``
    rows and ``row_group_bytes`` bytes, :func:`row_group_sizes`, known from the token counts
    before the forward): inside a row group they are forwarded in batches of similar length
    (right-padded, at most ``forward_batch_tokens`` padded tokens per batch), and the row group
    is written (streamed) before the next one is computed. Row order stays the conversations'
    order. A shard whose upload still fails after the store client's retries is rewritten from
    scratch with backoff (:func:`pipeline.storage.retry_transient`).
    """

    def __init__(self, target: str, dtype: str, layer_ids: list[int], template_kwargs: dict,
                 max_length: int, min_supervised: int, rows_per_row_group: int,
                 num_threads: int | None, storage_options: dict,
                 forward_batch_tokens: int = DEFAULT_FORWARD_BATCH_TOKENS,
                 retry_base_delay_s: float = 2.0,
                 row_group_bytes: int = DEFAULT_ROW_GROUP_BYTES):
        import torch

        from serve.target_loading import load_target, load_tokenizer

        if num_threads:
            torch.set_num_threads(num_threads)
        self.torch = torch
        self.tokenizer = load_tokenizer(target)
        self.model = load_target(target, dtype)
        hidden = self.model.config.hidden_size
        check_row_size(max_length, hidden, len(layer_ids))  # before any forward is spent
        self.bytes_per_token = bytes_per_token(hidden, len(layer_ids))
        self.row_group_bytes = row_group_bytes
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model.to(self.device)
        self.layer_ids = layer_ids
        self.template_kwargs = template_kwargs
        self.max_length = max_length
        self.min_supervised = min_supervised
        self.rows_per_row_group = rows_per_row_group
        self.storage_options = storage_options
        self.forward_batch_tokens = forward_batch_tokens
        self.retry_base_delay_s = retry_base_delay_s
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)

    def _tokenize(self, conv: dict) -> list[dict]:
        """Samples of one conversation: one, or one per assistant turn when the chat template
        renders history differently from a generated turn (``serve.chat``); ids ``<id>#<turn>``
        then. Each: ``sample_id``, ``domain``, ``input_ids`` and ``loss_mask`` (lists, [T]).

        Raises:
            ValueError: too few supervised tokens, no anchor position, or a template error.
        """
        from serve.chat import tokenize_conversation_samples

        samples = tokenize_conversation_samples(self.tokenizer, conv["messages"],
                                                self.template_kwargs, self.max_length)
        out = []
        for k, tok in enumerate(samples):
            if tok.num_supervised < self.min_supervised:
                raise ValueError(f"only {tok.num_supervised} supervised tokens "
                                 f"(< min_supervised_tokens {self.min_supervised})")
            mask = tok.loss_mask
            if not any(a and b for a, b in zip(mask, mask[1:])):
                raise ValueError("no anchor position (two consecutive supervised tokens)")
            out.append({"sample_id": conv["id"] if len(samples) == 1 else f"{conv['id']}#{k}",
                        "domain": conv.get("domain", "unknown"),
                        "input_ids": list(tok.input_ids), "loss_mask": list(tok.loss_mask)})
        return out

    def _forward(self, samples: list[dict]) -> pa.Table:
        """Cache rows of ``samples`` (same order, :func:`rows_table`) from right-padded batched
        target forwards (:func:`length_batches`): ``context_hidden`` bf16 [T, m*H] and
        ``last_hidden`` bf16 [T, H] of each sample's own T positions (attention is causal, so the
        padding after a sample cannot change them)."""
        torch = self.torch
        context: list = [None] * len(samples)
        last: list = [None] * len(samples)
        lengths = [len(s["input_ids"]) for s in samples]
        for batch in length_batches(lengths, self.forward_batch_tokens):
            width = lengths[batch[0]]
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)  # [B, T_max]
            attn = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T_max]
            for b, i in enumerate(batch):
                ids[b, :lengths[i]] = torch.tensor(samples[i]["input_ids"])
                attn[b, :lengths[i]] = 1
            with torch.no_grad():
                out = self.model.model(input_ids=ids.to(self.device),
                                       attention_mask=attn.to(self.device),
                                       output_hidden_states=True, use_cache=False)
            hs = out.hidden_states  # L + 1 tensors [B, T_max, H]; hs[l + 1]: decoder layer l
            # [B, T_max, m*H] and [B, T_max, H] (post-norm: exactly the LM head's input), bf16
            ctx = torch.cat([hs[l + 1] for l in self.layer_ids], dim=-1).to(torch.bfloat16).cpu()
            fin = out.last_hidden_state.to(torch.bfloat16).cpu()
            for b, i in enumerate(batch):
                context[i], last[i] = ctx[b, :lengths[i]], fin[b, :lengths[i]]
        return rows_table(samples, context, last)

    def write_shard(self, path: str, convs: list[dict], fingerprint: str) -> dict:
        """Tokenize, forward and stream one shard (a row group at a time), then write its
        sidecar.

        Returns:
            The sidecar (:meth:`ShardWriter.close` plus ``fingerprint`` and ``errors``).
        Raises:
            OSError: the store failed (nothing is left at the shard's path).
        """
        samples, errors = [], []
        for conv in convs:
            try:
                samples += self._tokenize(conv)
            except ValueError as err:  # bad data (mask, length, template) never sinks the shard
                errors.append({"id": conv["id"], "stage": "cache",
                               "error": f"{type(err).__name__}: {err}"})
        sizes = row_group_sizes([len(s["input_ids"]) * self.bytes_per_token for s in samples],
                                self.rows_per_row_group, self.row_group_bytes)
        with ShardWriter(path, self.storage_options, self.rows_per_row_group,
                         row_group_bytes=self.row_group_bytes) as writer:
            start = 0
            for n in sizes:
                writer.write_table(self._forward(samples[start:start + n]))
                start += n
            summary = {**writer.close(), "fingerprint": fingerprint, "errors": errors}
        write_sidecar(path, summary, self.storage_options)
        return summary

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        summaries = {"shard": [], "summary": []}
        for shard, path, fingerprint, rows_json in zip(batch["shard"], batch["path"],
                                                       batch["fingerprint"], batch["rows"]):
            path, convs = str(path), json.loads(rows_json)
            write = lambda: self.write_shard(path, convs, str(fingerprint))  # noqa: E731
            summary = (storage.retry_transient(write, what=f"cache shard {path}",
                                               base_delay_s=self.retry_base_delay_s)
                       if storage.is_url(path) else write())
            summaries["shard"].append(int(shard))
            summaries["summary"].append(json.dumps(summary))
        return summaries


def length_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped for batched forwards: longest first (ties by index), each
    batch at most ``max_tokens`` padded tokens (batch size x its longest length); a sample
    longer than that goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


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


def merge_token_counts(shards: list[dict]) -> dict[int, int]:
    """Sum the shards' ``supervised_token_counts``: {token id: count}."""
    total: dict[int, int] = {}
    for s in shards:
        for t, c in s.get("supervised_token_counts", {}).items():
            total[int(t)] = total.get(int(t), 0) + int(c)
    return total


DRAFT_VOCAB_REPORT_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)


def shard_fingerprint(rows: list[dict], settings: dict) -> str:
    """What a shard was made from: its sample ids and contents plus the cache settings. A sidecar
    with another fingerprint belongs to a different run and the shard is rewritten."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for row in rows:
        h.update(json.dumps([row["id"], row["messages"]], ensure_ascii=False).encode())
    return h.hexdigest()


def shard_bounds(ids: list[str], rows_per_shard: int) -> list[str]:
    """Deterministic shards of id-sorted conversations cut every ``rows_per_shard`` rows: the
    first id of every shard after the first (shard of an id = ``bisect_right(bounds, id)``).

    Raises:
        ValueError: an id occurs twice (naming it).
    """
    ids = sorted(ids)
    dup = next((a for a, b in zip(ids, ids[1:]) if a == b), None)
    if dup is not None:
        raise ValueError(f"conversation id {dup!r} occurs more than once in the generate output")
    return ids[rows_per_shard::rows_per_shard]


def _key_lines(batch: dict) -> dict:
    """Ray Data batch: JSON lines (``text``) -> ``id`` and the line itself; blank lines and an
    unreadable (truncated) line, left by a crash while appending, are dropped."""
    ids, texts = [], []
    for line in batch["text"]:
        line = str(line)
        if not line.strip():
            continue
        try:
            conv_id = json.loads(line)["id"]
        except (json.JSONDecodeError, KeyError, TypeError):
            logger.warning("generate output: ignoring an unreadable line (%.60s...)", line)
            continue
        ids.append(str(conv_id))
        texts.append(line)
    return {"id": np.array(ids, dtype=object), "text": np.array(texts, dtype=object)}


def _assign_shard(batch: dict, bounds: list[str]) -> dict:
    """Ray Data batch: add ``shard`` (int64) from ``id`` (:func:`shard_bounds`)."""
    shard = np.searchsorted(np.array(bounds, dtype=object), batch["id"], side="right")
    return {**batch, "shard": np.asarray(shard, dtype=np.int64)}


def _pack_shard(group: dict, split_dir: str, settings: dict) -> dict:
    """Ray Data ``map_groups``: the rows of one shard -> one row ``shard``, ``path``,
    ``fingerprint`` and ``rows`` (JSON list of its id-sorted conversations)."""
    order = np.argsort(group["id"].astype(str), kind="stable")
    convs = [json.loads(group["text"][i]) for i in order]
    shard = int(group["shard"][0])
    return {"shard": np.array([shard], dtype=np.int64),
            "path": np.array([storage.join(split_dir, shard_name(shard))], dtype=object),
            "fingerprint": np.array([shard_fingerprint(convs, settings)], dtype=object),
            "rows": np.array([json.dumps(convs, ensure_ascii=False)], dtype=object)}


# Ray's label of a node's id (every node carries it); a task pinned to a node selects it
NODE_ID_LABEL = "ray.io/node-id"


def conversations_dataset(conversations: list[dict] | str):
    """A Ray Data dataset of JSON lines (column ``text``): a JSONL file (local path, read on
    the driver's node, or s3://), or conversations given in memory (tests, small inputs)."""
    import ray

    if isinstance(conversations, str):
        if storage.is_url(conversations):
            return ray.data.read_text(conversations)
        # a local file lives on the driver's node, where the read must run (what Ray's
        # deprecated local:// scheme did, by this same node label); it asks for no CPU because a
        # cluster's head often offers none (the work it does is light file I/O)
        return ray.data.read_text(conversations, num_cpus=0, label_selector={
            NODE_ID_LABEL: ray.get_runtime_context().get_node_id()})
    return ray.data.from_items([{"text": json.dumps(c, ensure_ascii=False)}
                                for c in conversations])


def run_cache_split(conversations: list[dict] | str, split_dir: str, *, target: str, dtype: str,
                    layer_ids: list[int], template_kwargs: dict, max_length: int,
                    min_supervised: int, rows_per_shard: int, rows_per_row_group: int,
                    num_actors: int, cpus_per_actor: float, gpus_per_actor: float,
                    num_threads: int | None, storage_options: dict,
                    forward_batch_tokens: int = DEFAULT_FORWARD_BATCH_TOKENS,
                    row_group_bytes: int = DEFAULT_ROW_GROUP_BYTES) -> list[dict]:
    """Write the missing shards of one split; return every shard's summary (in shard order).

    The conversations are read as a Ray Data dataset (a generate output file is never loaded
    into the driver, which holds only the ids): shards are the id-sorted conversations cut every
    ``rows_per_shard``, packed one row per shard by a ``groupby``, fingerprinted there, and only
    shards without a sidecar of the same fingerprint go to the writer actors
    (:class:`CacheWriterUDF`; ``forward_batch_tokens`` is its batched-forward budget,
    ``rows_per_row_group`` and ``row_group_bytes`` cap its row groups). The row-group caps are
    not part of a shard's fingerprint: they change the layout, not the rows, so a shard written
    with other caps is kept.

    Args:
        conversations: a JSONL file of conversations (``id``, ``messages``, ``domain``; local or
            s3://) or the conversations themselves.
    Raises:
        ValueError: a conversation id occurs twice.
    """
    import ray
    from ray.data.expressions import col

    if not storage.is_url(split_dir):  # temporaries of writers killed mid-shard (never listed)
        for stale in Path(split_dir).glob(".shard-*.tmp-*"):
            stale.unlink(missing_ok=True)
    settings = {"target": target, "dtype": dtype, "layer_ids": layer_ids,
                "template_kwargs": template_kwargs, "max_length": max_length,
                "min_supervised": min_supervised,
                "summary": 2}  # 2: sidecars carry supervised_token_counts
    keyed = conversations_dataset(conversations).map_batches(
        _key_lines, batch_format="numpy").materialize()
    ids = [str(r["id"]) for r in keyed.select_columns(["id"]).take_all()]
    if not ids:
        return []
    bounds = shard_bounds(ids, rows_per_shard)
    packed = (keyed.map_batches(_assign_shard, fn_kwargs={"bounds": bounds}, batch_format="numpy")
              .groupby("shard", num_partitions=min(len(bounds) + 1, 64))
              .map_groups(_pack_shard, fn_kwargs={"split_dir": split_dir, "settings": settings},
                          batch_format="numpy")
              .materialize())
    summaries: dict[int, dict] = {}
    todo = set()
    for row in packed.select_columns(["shard", "path", "fingerprint"]).take_all():
        i, base, fingerprint = int(row["shard"]), str(row["path"]), str(row["fingerprint"])
        if storage.exists(base + ".json", storage_options):
            done = json.loads(storage.read_bytes(base + ".json", storage_options))
            if done.get("fingerprint") == fingerprint:
                summaries[i] = done
                continue
            logger.warning("%s was written from other inputs or settings: rewriting it", base)
        todo.add(i)
    num_shards = len(bounds) + 1
    if todo:
        logger.info("cache %s: writing %d of %d shards", split_dir, len(todo), num_shards)
        ds = packed.filter(expr=col("shard").is_in(sorted(todo)))
        ds = ds.repartition(len(todo)).map_batches(
            CacheWriterUDF,
            fn_constructor_kwargs=dict(
                target=target, dtype=dtype, layer_ids=layer_ids, template_kwargs=template_kwargs,
                max_length=max_length, min_supervised=min_supervised,
                rows_per_row_group=rows_per_row_group, num_threads=num_threads,
                storage_options=storage_options, forward_batch_tokens=forward_batch_tokens,
                row_group_bytes=row_group_bytes),
            batch_size=1, compute=ray.data.ActorPoolStrategy(size=num_actors),
            num_cpus=cpus_per_actor,
            num_gpus=gpus_per_actor or None, batch_format="numpy")
        for row in ds.iter_rows():
            summaries[int(row["shard"])] = json.loads(row["summary"])
    return [summaries[i] for i in range(num_shards)]


def build_manifest(*, target: str, revision: str | None, layer_ids: list[int], hidden_size: int,
                   vocab_size: int, template_sha256: str, template_kwargs: dict, max_length: int,
                   splits: dict[str, list[dict]]) -> dict:
    """The manifest of SPEC 1.4 (shard errors are moved out to the error file by the caller),
    with each split's supervised-token frequencies (``token_frequency``: [[id, count], ...], most
    frequent first) and the coverage of the train ranking's top-N at a few draft vocabulary sizes
    (``draft_vocab_coverage``: {N: {split: share of supervised tokens inside the top N}})."""
    from drafters.draft_vocab import coverage, frequency_ranking

    counts = {name: merge_token_counts(shards) for name, shards in splits.items()}
    ranking = frequency_ranking(counts.get("train", {}), vocab_size)
    report = {str(n): {name: round(coverage(c, ranking[:n]), 5) for name, c in counts.items()}
              for n in DRAFT_VOCAB_REPORT_SIZES if n < vocab_size}
    manifest = {
        "format": CACHE_FORMAT,
        "target": {"name_or_path": target, "revision": revision, "hidden_size": hidden_size,
                   "vocab_size": vocab_size},
        "layer_ids": layer_ids,
        "num_context_layers": len(layer_ids),
        "dtypes": {"input_ids": "int32", "loss_mask": "uint8", "context_hidden": "bfloat16",
                   "last_hidden": "bfloat16"},
        "chat_template_sha256": template_sha256,
        "chat_template_kwargs": template_kwargs,
        "max_length": max_length,
        "bytes_per_token": bytes_per_token(hidden_size, len(layer_ids)),
        "splits": {
            name: {"rows": sum(s["rows"] for s in shards),
                   "tokens": sum(s["tokens"] for s in shards),
                   "supervised_tokens": sum(s["supervised_tokens"] for s in shards),
                   "token_frequency": sorted(([t, c] for t, c in counts[name].items()),
                                             key=lambda tc: (-tc[1], tc[0])),
                   "shards": [{k: v for k, v in s.items()
                               if k not in ("errors", "fingerprint", "supervised_token_counts")}
                              for s in shards]}
            for name, shards in splits.items()
        },
        "draft_vocab_coverage": report,
    }
    return manifest


def read_manifest(cache_dir: str, storage_options: dict | None = None) -> dict:
    """Load and check ``manifest.json``.

    Raises:
        FileNotFoundError: no manifest (the cache stage has not completed).
        CorruptShardError: unknown format.
    """
    path = storage.join(cache_dir, "manifest.json")
    if not storage.exists(path, storage_options):
        raise FileNotFoundError(f"no target cache manifest at {path}; run the cache stage first")
    manifest = json.loads(storage.read_bytes(path, storage_options))
    if manifest.get("format") != CACHE_FORMAT:
        raise CorruptShardError(f"{path}: format {manifest.get('format')!r}, expected {CACHE_FORMAT}")
    return manifest


class CacheMismatchError(ValueError):
    """A target cache written for another target or for other target layers."""


def check_cache_matches(manifest: dict, cache_dir: str, *, target: str, hidden_size: int,
                        vocab_size: int, layer_ids: list[int]) -> None:
    """Check that the cache at ``cache_dir`` (its ``manifest``) was written for this target.

    Args:
        target: the config's ``target.name_or_path``; hidden_size / vocab_size: its config's.
        layer_ids: the drafter's target layers.
    Raises:
        CacheMismatchError: naming the manifest and every field that differs.
    """
    recorded = manifest.get("target", {})
    want = {"target.name_or_path": (recorded.get("name_or_path"), target),
            "target.hidden_size": (recorded.get("hidden_size"), hidden_size),
            "target.vocab_size": (recorded.get("vocab_size"), vocab_size),
            "layer_ids": (manifest.get("layer_ids"), list(layer_ids))}
    diff = [f"{k}: cache {have!r}, config {need!r}" for k, (have, need) in want.items()
            if have != need]
    if diff:
        raise CacheMismatchError(
            f"{storage.join(cache_dir, 'manifest.json')} is a cache of another target or layer "
            f"choice ({'; '.join(diff)}): point cache.output at another location (or a cache "
            "of this target); --force cache would delete this one")


def verify_shard(cache_dir: str, split: str, shard: dict, storage_options: dict | None = None) -> None:
    """Check a shard's bytes against the manifest's sha256.

    Raises:
        CorruptShardError: naming the shard file.
    """
    path = storage.join(cache_dir, split, shard["file"])
    data = storage.read_bytes(path, storage_options)
    if hashlib.sha256(data).hexdigest() != shard["sha256"]:
        raise CorruptShardError(f"shard {path} does not match its manifest hash")
    try:
        table = pq.read_table(io.BytesIO(data))
    except Exception as err:
        raise CorruptShardError(f"shard {path} is not readable Parquet: {err}") from err
    if table.num_rows != shard["rows"] or not table.schema.equals(SCHEMA, check_metadata=False):
        raise CorruptShardError(f"shard {path}: {table.num_rows} rows / schema differ from manifest")
