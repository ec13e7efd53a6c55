"""The target cache on disk (SPEC 1.4): what the cache stage writes and training reads.

Layout of ``<output>/<split>/``: ``shard-NNNNN.parquet`` files plus a ``shard-NNNNN.json`` sidecar
written after the shard (its presence marks the shard complete), and ``<output>/manifest.json``.
Shards are deterministic slices of the conversations in cache order (:func:`shard_key`: hashed ids,
so every shard mixes sources and domains), so a re-run writes only missing shards. Each worker
writes its own shards, streaming them row group by row group (a local temporary renamed when
complete, or an S3 multipart upload completed when complete); nothing V-sized or cache-sized passes
the driver.

Columns (hidden states as raw little-endian bytes plus explicit sizes, readable by any Parquet
reader): ``sample_id`` string, ``domain`` string, ``num_tokens`` int32, ``input_ids`` binary
(int32 [T]), ``loss_mask`` binary (uint8 [T]), ``context_hidden`` binary (bf16 [T, m*H], layers
concatenated in ascending order), ``last_hidden`` binary (bf16 [T, H], the LM head's input).

This module is the format: the schema, decoding a row, the manifest and checking a cache
(:mod:`pipeline.cache.writer` writes shards, :mod:`pipeline.cache.stage` runs the stage).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from drafters.draft_vocab import coverage, frequency_ranking

from .. import storage
from ..plan import bytes_per_token

CACHE_FORMAT = "dspark-target-cache/v1"
SCHEMA = pa.schema([
    ("sample_id", pa.string()), ("domain", pa.string()), ("num_tokens", pa.int32()),
    ("input_ids", pa.binary()), ("loss_mask", pa.binary()),
    ("context_hidden", pa.binary()), ("last_hidden", pa.binary()),
])


class CorruptShardError(ValueError):
    """A cache row or shard does not match its manifest (sizes, hash or schema)."""


def check_schema(schema: pa.Schema, path: str) -> None:
    """Refuse a shard whose columns drifted from :data:`SCHEMA` (written by another tool or
    version: a ``large_binary`` or list column, a missing one), naming the shard, each column and
    its type, before any row is decoded (the reader reads the byte columns' int32 offsets, so
    another type would decode as garbage or as empty rows).

    Args:
        schema: the shard's Arrow schema (e.g. its Parquet footer's
            ``metadata.schema.to_arrow_schema()``).
        path: the shard, for the message.
    Raises:
        CorruptShardError: listing every missing or mistyped column.
    """
    problems = []
    for field in SCHEMA:
        i = schema.get_field_index(field.name)
        if i < 0:
            problems.append(f"{field.name} is missing")
        elif not schema.field(i).type.equals(field.type):
            problems.append(f"{field.name} is {schema.field(i).type}, expected {field.type}")
    if problems:
        raise CorruptShardError(
            f"cache shard {path} does not have the cache schema ({CACHE_FORMAT}): "
            + "; ".join(problems) + ". It was written by another tool or version: re-run the "
            "cache stage for it (pipeline/run.py --stages cache --repair-cache, or --force cache)")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def shard_key(conversation_id: str) -> str:
    """Where a conversation goes in the cache's order: a hash of its id, then the id. Shards
    are cut from this order, so each holds conversations of every source and domain (ids start
    with their source's name: sorted by id alone, a shard and every batch read from it would be
    one source), and the first held-out rows that training evaluates on are a random sample of
    the held-out split. Deterministic, so a re-run cuts the same shards."""
    digest = hashlib.blake2b(conversation_id.encode(), digest_size=8).hexdigest()
    return f"{digest}:{conversation_id}"


def parse_conversation_line(line: str) -> tuple[str, dict] | None:
    """(id, conversation) of one JSON line of a generate output; None for a blank line or an
    unreadable one (a torn last line left by a crash while appending)."""
    if not line.strip():
        return None
    try:
        conv = json.loads(line)
        return str(conv["id"]), conv
    except (json.JSONDecodeError, KeyError, TypeError):
        logging.getLogger(__name__).warning(
            "generate output: ignoring an unreadable line (%.60s...)", line)
        return None


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


def merge_token_counts(shards: list[dict]) -> dict[int, int]:
    """Sum the shards' ``supervised_token_counts``: {token id: count}."""
    total: dict[int, int] = {}
    for s in shards:
        for t, c in s.get("supervised_token_counts", {}).items():
            total[int(t)] = total.get(int(t), 0) + int(c)
    return total


DRAFT_VOCAB_REPORT_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)


def build_manifest(*, target: str, revision: str | None, layer_ids: list[int], hidden_size: int,
                   vocab_size: int, template_sha256: str, template_kwargs: dict, max_length: int,
                   splits: dict[str, list[dict]]) -> dict:
    """The manifest of SPEC 1.4 (shard errors are moved out to the error file by the caller),
    with each split's supervised-token frequencies (``token_frequency``: [[id, count], ...], most
    frequent first) and the coverage of the train ranking's top-N at a few draft vocabulary sizes
    (``draft_vocab_coverage``: {N: {split: share of supervised tokens inside the top N}})."""
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
    check_schema(table.schema, path)
    if table.num_rows != shard["rows"]:
        raise CorruptShardError(f"shard {path}: {table.num_rows} rows, the manifest says "
                                f"{shard['rows']}")
