"""Cache stage: one target forward per sample (samples of similar length batched together), written
as the target cache of SPEC 1.4 (:mod:`pipeline.cache_format`) by Ray Data actors
(:class:`CacheWriterUDF`, through :mod:`pipeline.cache_writer`).

Shards are deterministic slices of the conversations in cache order (hashed ids,
:func:`pipeline.cache_format.shard_key`), so a re-run writes only missing shards. Each worker writes
its own shards, streaming them row group by row group; nothing V-sized or cache-sized passes the
driver.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa

from . import storage
from .cache_format import parse_conversation_line, shard_key, shard_name
from .cache_writer import ShardWriter, read_sidecar, row_group_sizes, write_sidecar
from .config import CacheConfig
from .target_features import CacheTarget, TargetFeatures, length_batches  # noqa: F401 (API)

logger = logging.getLogger(__name__)


class CacheWriterUDF(TargetFeatures):
    """Ray Data callable class: tokenizes conversations, runs the target, writes one shard per
    input row. Input columns: ``shard`` (int), ``path`` (shard base path without suffix),
    ``fingerprint`` and ``rows`` (JSON list of conversations). Output: one summary row per shard.

    A shard's samples go to the target a row group at a time (at most ``rows_per_row_group``
    rows and ``row_group_bytes`` bytes, :func:`row_group_sizes`, known from the token counts
    before the forward): inside a row group they are forwarded in batches of similar length
    (:meth:`TargetFeatures.forward`), and the row group is written (streamed) before the next one
    is computed. Row order stays the conversations' order. A shard whose upload still fails after
    the store client's retries is rewritten from scratch with backoff
    (:func:`pipeline.storage.retry_transient`).
    """

    def __init__(self, target: CacheTarget, cache: CacheConfig, storage_options: dict,
                 retry_base_delay_s: float = 2.0):
        super().__init__(target, cache)
        self.row_group_bytes = cache.row_group_bytes
        self.rows_per_row_group = cache.rows_per_row_group
        self.storage_options = storage_options
        self.retry_base_delay_s = retry_base_delay_s

    def write_shard(self, path: str, convs: list[dict], fingerprint: str) -> dict:
        """Tokenize, forward and stream one shard (a row group at a time), then write its
        sidecar.

        Returns:
            The sidecar (:meth:`ShardWriter.close` plus ``fingerprint`` and ``errors``).
        Raises:
            OSError: the store failed (nothing is left at the shard's path).
        """
        samples, errors = self.tokenize_all(convs, "cache")
        sizes = row_group_sizes([len(s["input_ids"]) * self.bytes_per_token for s in samples],
                                self.rows_per_row_group, self.row_group_bytes)
        with ShardWriter(path, self.storage_options, self.rows_per_row_group,
                         row_group_bytes=self.row_group_bytes) as writer:
            start = 0
            for n in sizes:
                writer.write_table(self.forward(samples[start:start + n]))
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


def shard_fingerprint(rows: list[dict], settings: dict) -> str:
    """What a shard was made from: its sample ids and contents plus the cache settings. A sidecar
    with another fingerprint belongs to a different run and the shard is rewritten."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for row in rows:
        h.update(json.dumps([row["id"], row["messages"]], ensure_ascii=False).encode())
    return h.hexdigest()


def shard_bounds(ids: list[str], rows_per_shard: int) -> list[str]:
    """Deterministic shards of the conversations in cache order
    (:func:`pipeline.cache_format.shard_key`) cut every ``rows_per_shard`` rows: the first key of
    every shard after the first (shard of an id = ``bisect_right(bounds, shard_key(id))``).

    Raises:
        ValueError: an id occurs twice (naming it).
    """
    ids = sorted(ids)
    dup = next((a for a, b in zip(ids, ids[1:]) if a == b), None)
    if dup is not None:
        raise ValueError(f"conversation id {dup!r} occurs more than once in the generate output")
    return sorted(shard_key(i) for i in ids)[rows_per_shard::rows_per_shard]


def _key_lines(batch: dict) -> dict:
    """Ray Data batch: JSON lines (``text``) -> ``id``, its ``key`` in cache order and the line
    itself; blank and unreadable (torn) lines are dropped
    (:func:`pipeline.cache_format.parse_conversation_line`)."""
    ids, keys, texts = [], [], []
    for line in batch["text"]:
        parsed = parse_conversation_line(str(line))
        if parsed is not None:
            ids.append(parsed[0])
            keys.append(shard_key(parsed[0]))
            texts.append(str(line))
    return {"id": np.array(ids, dtype=object), "key": np.array(keys, dtype=object),
            "text": np.array(texts, dtype=object)}


def _assign_shard(batch: dict, bounds: list[str]) -> dict:
    """Ray Data batch: add ``shard`` (int64) from ``key`` (:func:`shard_bounds`)."""
    shard = np.searchsorted(np.array(bounds, dtype=object), batch["key"], side="right")
    return {**batch, "shard": np.asarray(shard, dtype=np.int64)}


def _pack_shard(group: dict, split_dir: str, settings: dict) -> dict:
    """Ray Data ``map_groups``: the rows of one shard -> one row ``shard``, ``path``,
    ``fingerprint`` and ``rows`` (JSON list of its conversations in cache order)."""
    order = np.argsort(group["key"].astype(str), kind="stable")
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


def pack_shards(conversations: list[dict] | str, cache_dir: str, split: str,
                target: CacheTarget, cache: CacheConfig):
    """The split's shards as a materialized Ray Data dataset, one row per shard (``shard``,
    ``path``, ``fingerprint``, ``rows``: its conversations in cache order as JSON), and the number of
    shards; (None, 0) when there are no conversations. Stale temporaries of writers killed
    mid-shard are removed.

    Raises:
        ValueError: a conversation id occurs twice.
    """
    split_dir = storage.join(cache_dir, split)
    if not storage.is_url(split_dir):  # temporaries of writers killed mid-shard (never listed)
        for stale in Path(split_dir).glob(".shard-*.tmp-*"):
            stale.unlink(missing_ok=True)
    # what a shard's rows depend on (its fingerprint; unchanged since sidecars of summary 2)
    settings = {"target": target.name_or_path, "dtype": target.dtype,
                "layer_ids": list(target.layer_ids), "template_kwargs": target.template_kwargs,
                "max_length": cache.max_length, "min_supervised": cache.min_supervised_tokens,
                "summary": 2,  # 2: sidecars carry supervised_token_counts
                "order": "shard_key"}  # shards cut in hashed-id order (cache_format.shard_key)
    keyed = conversations_dataset(conversations).map_batches(
        _key_lines, batch_format="numpy").materialize()
    ids = [str(r["id"]) for r in keyed.select_columns(["id"]).take_all()]
    if not ids:
        return None, 0
    bounds = shard_bounds(ids, cache.rows_per_shard)
    packed = (keyed.map_batches(_assign_shard, fn_kwargs={"bounds": bounds}, batch_format="numpy")
              .groupby("shard", num_partitions=min(len(bounds) + 1, 64))
              .map_groups(_pack_shard, fn_kwargs={"split_dir": split_dir, "settings": settings},
                          batch_format="numpy")
              .materialize())
    return packed, len(bounds) + 1


def run_cache_split(conversations: list[dict] | str, cache_dir: str, split: str,
                    target: CacheTarget, cache: CacheConfig,
                    storage_options: dict) -> list[dict]:
    """Write the missing shards of one split; return every shard's summary (in shard order).

    The conversations are read as a Ray Data dataset (a generate output file is never loaded into
    the driver, which holds only the ids): shards are the conversations in cache order
    (``cache_format.shard_key``) cut every ``rows_per_shard``, packed one row per shard by a
    ``groupby``, fingerprinted there, and only shards without a sidecar of the same fingerprint go
    to the writer actors (:class:`CacheWriterUDF`; ``cache.forward_batch_tokens`` is its
    batched-forward budget, ``cache.rows_per_row_group`` and ``cache.row_group_bytes`` cap its row
    groups). The row-group caps are not part of a shard's fingerprint: they change the layout, not
    the rows, so a shard written with other caps is kept.

    Args:
        conversations: a JSONL file of conversations (``id``, ``messages``, ``domain``; local or
            s3://) or the conversations themselves.
        cache_dir: the cache's location (local or s3://); the split's shards go under
            ``<cache_dir>/<split>/``.
        split: "train" or "heldout".
        target: the target to forward; cache: the ``cache:`` config section.
    Raises:
        ValueError: a conversation id occurs twice.
    """
    import ray
    from ray.data.expressions import col

    packed, num_shards = pack_shards(conversations, cache_dir, split, target, cache)
    if packed is None:
        return []
    split_dir = storage.join(cache_dir, split)
    summaries: dict[int, dict] = {}
    todo = set()
    for row in packed.select_columns(["shard", "path", "fingerprint"]).take_all():
        i, base, fingerprint = int(row["shard"]), str(row["path"]), str(row["fingerprint"])
        done = read_sidecar(base, storage_options)
        if done is not None:
            if done.get("fingerprint") == fingerprint:
                summaries[i] = done
                continue
            logger.warning("%s was written from other inputs or settings: rewriting it", base)
        todo.add(i)
    if todo:
        logger.info("cache %s: writing %d of %d shards", split_dir, len(todo), num_shards)
        ds = packed.filter(expr=col("shard").is_in(sorted(todo)))
        ds = ds.repartition(len(todo)).map_batches(
            CacheWriterUDF,
            fn_constructor_kwargs=dict(target=target, cache=cache,
                                       storage_options=storage_options),
            batch_size=1, compute=ray.data.ActorPoolStrategy(size=cache.num_actors),
            num_cpus=cache.cpus_per_actor,
            num_gpus=cache.gpus_per_actor or None, batch_format="numpy")
        for row in ds.iter_rows():
            summaries[int(row["shard"])] = json.loads(row["summary"])
    return [summaries[i] for i in range(num_shards)]
