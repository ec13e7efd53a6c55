"""Cache stage: one target forward per sample, written as the target cache of SPEC 1.4.

Layout of ``<output>/<split>/``: ``shard-NNNNN.parquet`` files plus a ``shard-NNNNN.json`` sidecar
written after the shard (its presence marks the shard complete), and ``<output>/manifest.json``.
Shards are deterministic slices of the id-sorted conversations, so a re-run writes only missing
shards. Each worker writes its own shards (nothing V-sized or cache-sized passes the driver).

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
import pyarrow.parquet as pq

from . import storage

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


def bf16_bytes(t) -> bytes:
    """A bf16 torch tensor's raw bytes (numpy has no bf16, so go through int16)."""
    import torch

    return t.to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy().tobytes()


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
    as_bf16 = lambda b, width: torch.from_numpy(b.view("<i2").copy()).view(torch.bfloat16).view(t, width)
    return {
        "sample_id": sample_id,
        "input_ids": torch.from_numpy(cols["input_ids"].view("<i4").astype(np.int64)),
        "loss_mask": torch.from_numpy(cols["loss_mask"].copy()),
        "context_hidden": as_bf16(cols["context_hidden"], w),
        "last_hidden": as_bf16(cols["last_hidden"], hidden_size),
    }


class CacheWriterUDF:
    """Ray Data callable class: tokenizes conversations, runs the target, writes one shard per
    input row. Input columns: ``shard`` (int), ``path`` (shard base path without suffix),
    ``rows`` (JSON list of conversations). Output: one summary row per shard."""

    def __init__(self, target: str, dtype: str, layer_ids: list[int], template_kwargs: dict,
                 max_length: int, min_supervised: int, rows_per_row_group: int,
                 num_threads: int | None, storage_options: dict):
        import torch

        from serve.target_loading import load_target, load_tokenizer

        if num_threads:
            torch.set_num_threads(num_threads)
        self.torch = torch
        self.tokenizer = load_tokenizer(target)
        self.model = load_target(target, dtype)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model.to(self.device)
        self.layer_ids = layer_ids
        self.template_kwargs = template_kwargs
        self.max_length = max_length
        self.min_supervised = min_supervised
        self.rows_per_row_group = rows_per_row_group
        self.storage_options = storage_options

    def _encode(self, conv: dict) -> list[dict]:
        """Cache rows of one conversation: one, or one per assistant turn when the chat template
        renders history differently from a generated turn (``serve.chat``); ids ``<id>#<turn>``
        then."""
        from serve.chat import tokenize_conversation_samples

        samples = tokenize_conversation_samples(self.tokenizer, conv["messages"],
                                                self.template_kwargs, self.max_length)
        rows = []
        for k, tok in enumerate(samples):
            if tok.num_supervised < self.min_supervised:
                raise ValueError(f"only {tok.num_supervised} supervised tokens "
                                 f"(< min_supervised_tokens {self.min_supervised})")
            mask = tok.loss_mask
            if not any(a and b for a, b in zip(mask, mask[1:])):
                raise ValueError("no anchor position (two consecutive supervised tokens)")
            ids = self.torch.tensor([tok.input_ids], device=self.device)
            with self.torch.no_grad():
                out = self.model.model(input_ids=ids, output_hidden_states=True, use_cache=False)
            hs = out.hidden_states  # L + 1 tensors; hs[l + 1] is decoder layer l's output
            context = self.torch.cat([hs[l + 1][0] for l in self.layer_ids], dim=-1)
            last = out.last_hidden_state[0]  # post-norm: exactly the LM head's input
            rows.append({
                "sample_id": conv["id"] if len(samples) == 1 else f"{conv['id']}#{k}",
                "domain": conv.get("domain", "unknown"),
                "num_tokens": len(tok.input_ids),
                "input_ids": np.asarray(tok.input_ids, dtype="<i4").tobytes(),
                "loss_mask": np.asarray(tok.loss_mask, dtype=np.uint8).tobytes(),
                "context_hidden": bf16_bytes(context), "last_hidden": bf16_bytes(last),
            })
        return rows

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        summaries = {"shard": [], "summary": []}
        for shard, path, fingerprint, rows_json in zip(batch["shard"], batch["path"],
                                                       batch["fingerprint"], batch["rows"]):
            records, errors = [], []
            for conv in json.loads(rows_json):
                try:
                    records += self._encode(conv)
                except ValueError as err:  # bad data (mask, length, template) never sinks the shard
                    errors.append({"id": conv["id"], "stage": "cache",
                                   "error": f"{type(err).__name__}: {err}"})
            summary = write_shard(path, records, rows_per_row_group=self.rows_per_row_group,
                                  storage_options=self.storage_options,
                                  extra={"fingerprint": str(fingerprint), "errors": errors})
            summaries["shard"].append(int(shard))
            summaries["summary"].append(json.dumps(summary))
        return summaries


def write_shard(path: str, records: list[dict], *, rows_per_row_group: int,
                storage_options: dict, extra: dict | None = None) -> dict:
    """Write one shard: ``<path>.parquet`` (atomically), then its ``<path>.json`` sidecar, whose
    presence marks the shard complete.

    Args:
        path: shard base path (local or s3://) without suffix.
        records: cache rows (columns of :data:`SCHEMA`, byte columns as ``bytes``).
        rows_per_row_group: Parquet row group size (rows).
        extra: more sidecar fields (``fingerprint``, ``errors``).
    Returns:
        The sidecar: ``file``, ``rows``, ``tokens``, ``supervised_tokens``,
        ``supervised_token_counts``, ``bytes``, ``sha256`` and ``extra``.
    Raises:
        OSError: the store failed (nothing is left at the shard's path).
    """
    table = pa.Table.from_pylist(records, schema=SCHEMA)
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=rows_per_row_group, compression="zstd")
    data = buf.getvalue()
    storage.write_bytes_atomic(path + ".parquet", data, storage_options)
    summary = {"file": path.rsplit("/", 1)[-1] + ".parquet", "rows": len(records),
               "tokens": int(sum(r["num_tokens"] for r in records)),
               "supervised_tokens": int(sum(sum(r["loss_mask"]) for r in records)),
               "supervised_token_counts": supervised_token_counts(records),
               "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), **(extra or {})}
    # the sidecar is written last: its presence marks the shard complete
    storage.write_bytes_atomic(path + ".json", json.dumps(summary).encode(), storage_options)
    return summary


def supervised_token_counts(records: list[dict]) -> dict[str, int]:
    """How often each target token is a supervised (assistant) token in these cache rows:
    {str(token id): count}, the input of the draft vocabulary's frequency ranking."""
    counts = np.zeros(0, dtype=np.int64)
    for r in records:
        ids = np.frombuffer(r["input_ids"], dtype="<i4")
        mask = np.frombuffer(r["loss_mask"], dtype=np.uint8).astype(bool)
        c = np.bincount(ids[mask], minlength=counts.size)
        counts = np.pad(counts, (0, c.size - counts.size)) + c
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


def plan_shards(conversations: list[dict], rows_per_shard: int) -> list[list[dict]]:
    """Deterministic shards: id-sorted conversations cut every ``rows_per_shard`` rows."""
    convs = sorted(conversations, key=lambda c: c["id"])
    return [convs[i:i + rows_per_shard] for i in range(0, len(convs), rows_per_shard)]


def run_cache_split(conversations: list[dict], split_dir: str, *, target: str, dtype: str,
                    layer_ids: list[int], template_kwargs: dict, max_length: int,
                    min_supervised: int, rows_per_shard: int, rows_per_row_group: int,
                    num_actors: int, cpus_per_actor: float, gpus_per_actor: float,
                    num_threads: int | None, storage_options: dict) -> list[dict]:
    """Write the missing shards of one split; return every shard's summary (in shard order)."""
    import ray

    shards = plan_shards(conversations, rows_per_shard)
    if not storage.is_url(split_dir):  # temporaries of writers killed mid-shard (never listed)
        for stale in Path(split_dir).glob(".shard-*.tmp-*"):
            stale.unlink(missing_ok=True)
    settings = {"target": target, "dtype": dtype, "layer_ids": layer_ids,
                "template_kwargs": template_kwargs, "max_length": max_length,
                "min_supervised": min_supervised,
                "summary": 2}  # 2: sidecars carry supervised_token_counts
    summaries: dict[int, dict] = {}
    todo = []
    for i, rows in enumerate(shards):
        base = storage.join(split_dir, shard_name(i))
        fingerprint = shard_fingerprint(rows, settings)
        if storage.exists(base + ".json", storage_options):
            done = json.loads(storage.read_bytes(base + ".json", storage_options))
            if done.get("fingerprint") == fingerprint:
                summaries[i] = done
                continue
            logger.warning("%s was written from other inputs or settings: rewriting it", base)
        todo.append({"shard": i, "path": base, "fingerprint": fingerprint,
                     "rows": json.dumps(rows, ensure_ascii=False)})
    if todo:
        logger.info("cache %s: writing %d of %d shards", split_dir, len(todo), len(shards))
        ds = ray.data.from_items(todo, override_num_blocks=len(todo))
        ds = ds.map_batches(
            CacheWriterUDF,
            fn_constructor_kwargs=dict(
                target=target, dtype=dtype, layer_ids=layer_ids, template_kwargs=template_kwargs,
                max_length=max_length, min_supervised=min_supervised,
                rows_per_row_group=rows_per_row_group, num_threads=num_threads,
                storage_options=storage_options),
            batch_size=1, concurrency=num_actors, num_cpus=cpus_per_actor,
            num_gpus=gpus_per_actor or None, batch_format="numpy")
        for row in ds.iter_rows():
            summaries[int(row["shard"])] = json.loads(row["summary"])
    return [summaries[i] for i in range(len(shards))]


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
        "bytes_per_token": (len(layer_ids) + 1) * hidden_size * 2 + 5,
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
