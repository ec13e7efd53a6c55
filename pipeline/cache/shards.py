"""How the conversations of a generate output become cache shards (the cache stage's plan,
SPEC 1.4): keyed in cache order (:func:`pipeline.cache.format.shard_key`), cut every
``rows_per_shard`` rows, packed one row per shard and fingerprinted, all as Ray Data passes.

Kept apart from :mod:`pipeline.cache.stage` (the writer, which needs torch and the target): these
functions run in Ray Data tasks, and a task's worker imports the module of its function; this one
imports in a tenth of a second, ``pipeline.cache.stage`` in about two (torch, transformers).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .. import storage
from .format import parse_conversation_line, shard_key, shard_name

if TYPE_CHECKING:
    from ..config import CacheConfig
    from ..target_features import CacheTarget


def shard_fingerprint(rows: list[dict], settings: dict) -> str:
    """What a shard was made from: its sample ids and contents plus the cache settings. A sidecar
    with another fingerprint belongs to a different run and the shard is rewritten."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for row in rows:
        h.update(json.dumps([row["id"], row["messages"]], ensure_ascii=False).encode())
    return h.hexdigest()


def shard_bounds(ids: list[str], rows_per_shard: int) -> list[str]:
    """Deterministic shards of the conversations in cache order
    (:func:`pipeline.cache.format.shard_key`) cut every ``rows_per_shard`` rows: the first key of
    every shard after the first (shard of an id = ``bisect_right(bounds, shard_key(id))``).

    Raises:
        ValueError: an id occurs twice (naming it).
    """
    ids = sorted(ids)
    dup = next((a for a, b in zip(ids, ids[1:]) if a == b), None)
    if dup is not None:
        raise ValueError(f"conversation id {dup!r} occurs more than once in the generate output")
    return sorted(shard_key(i) for i in ids)[rows_per_shard::rows_per_shard]


def _key_lines(batch: dict, split: str) -> dict:
    """Ray Data batch: JSON lines (``text``) -> ``split``, ``id``, its ``key`` in cache order and
    the line itself; blank and unreadable (torn) lines are dropped
    (:func:`pipeline.cache.format.parse_conversation_line`)."""
    ids, keys, texts = [], [], []
    for line in batch["text"]:
        parsed = parse_conversation_line(str(line))
        if parsed is not None:
            ids.append(parsed[0])
            keys.append(shard_key(parsed[0]))
            texts.append(str(line))
    return {"split": np.array([split] * len(ids), dtype=object),
            "id": np.array(ids, dtype=object), "key": np.array(keys, dtype=object),
            "text": np.array(texts, dtype=object)}


def _assign_shard(batch: dict, bounds: dict[str, list[str]]) -> dict:
    """Ray Data batch: add ``shard`` (int64, within the row's split) from ``split`` and ``key``
    (:func:`shard_bounds` of each split)."""
    shard = np.zeros(len(batch["key"]), dtype=np.int64)
    for split, split_bounds in bounds.items():
        rows = batch["split"] == split
        shard[rows] = np.searchsorted(np.array(split_bounds, dtype=object), batch["key"][rows],
                                      side="right")
    return {**batch, "shard": shard}


def _pack_shard(group: dict, cache_dir: str, settings: dict) -> dict:
    """Ray Data ``map_groups``: the rows of one shard of one split -> one row ``split``,
    ``shard``, ``path``, ``fingerprint`` and ``rows`` (JSON list of its conversations in cache
    order)."""
    order = np.argsort(group["key"].astype(str), kind="stable")
    convs = [json.loads(group["text"][i]) for i in order]
    split, shard = str(group["split"][0]), int(group["shard"][0])
    return {"split": np.array([split], dtype=object), "shard": np.array([shard], dtype=np.int64),
            "path": np.array([storage.join(cache_dir, split, shard_name(shard))], dtype=object),
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


def pack_shards(splits: dict[str, list[dict] | str], cache_dir: str, target: CacheTarget,
                cache: CacheConfig):
    """Every split's shards as one materialized Ray Data dataset, one row per shard (``split``,
    ``shard``, ``path``, ``fingerprint``, ``rows``: its conversations in cache order as JSON), and
    the number of shards of each split (splits without conversations have none and no rows);
    (None, {}) when no split has conversations. Stale temporaries of writers killed mid-shard are
    removed.

    Args:
        splits: split -> its conversations (:func:`conversations_dataset`: a JSONL file or the
            conversations themselves); its shards go under ``<cache_dir>/<split>/``.
    Raises:
        ValueError: a conversation id occurs twice in a split.
    """
    from ray.data.context import ShuffleStrategy

    for split in splits:
        split_dir = storage.join(cache_dir, split)
        if not storage.is_url(split_dir):  # temporaries of writers killed mid-shard (never listed)
            for stale in Path(split_dir).glob(".shard-*.tmp-*"):
                stale.unlink(missing_ok=True)
    # what a shard's rows depend on (its fingerprint; unchanged since sidecars of summary 2)
    settings = {"target": target.name_or_path, "dtype": target.dtype,
                "layer_ids": list(target.layer_ids), "template_kwargs": target.template_kwargs,
                "max_length": cache.max_length, "min_supervised": cache.min_supervised_tokens,
                "summary": 2,  # 2: sidecars carry supervised_token_counts
                "order": "shard_key"}  # shards cut in hashed-id order (pipeline.cache.format.shard_key)
    # one pass for all splits: a Ray Data pass costs seconds of start-up whatever its size
    keyed = None
    for split, conversations in splits.items():
        ds = conversations_dataset(conversations).map_batches(
            _key_lines, fn_kwargs={"split": split}, batch_format="numpy")
        keyed = ds if keyed is None else keyed.union(ds)
    if keyed is None:
        return None, {}
    # the packing groupby moves conversation text, not hidden states: Ray's sort-based pull shuffle
    # runs it as plain tasks, where the default strategy starts a pool of aggregator actors per
    # pass (30 s and 120 CPU-seconds on a 2-core machine for 12 conversations, against 2 s and
    # 40 CPU-seconds). The datasets above copied the current context, so only they are changed.
    # Its sort runs one task per block of ``keyed`` (a JSONL file's blocks are ~128 MiB of text),
    # so the groupby takes no partition count.
    keyed.context.shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
    keyed = keyed.materialize()
    ids: dict[str, list[str]] = {}
    for row in keyed.select_columns(["split", "id"]).take_all():
        ids.setdefault(str(row["split"]), []).append(str(row["id"]))
    if not ids:
        return None, {}
    bounds = {split: shard_bounds(split_ids, cache.rows_per_shard)
              for split, split_ids in ids.items()}
    num_shards = {split: len(b) + 1 for split, b in bounds.items()}
    packed = (keyed.map_batches(_assign_shard, fn_kwargs={"bounds": bounds}, batch_format="numpy")
              .groupby(["split", "shard"])
              .map_groups(_pack_shard, fn_kwargs={"cache_dir": cache_dir, "settings": settings},
                          batch_format="numpy")
              .materialize())
    return packed, num_shards
