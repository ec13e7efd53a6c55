"""Cache stage: one target forward per sample (samples of similar length batched together), written
as the target cache of SPEC 1.4 (:mod:`pipeline.cache.format`) by Ray Data actors
(:class:`CacheWriterUDF`, through :mod:`pipeline.cache.writer`).

Shards are deterministic slices of the conversations in cache order (hashed ids,
:func:`pipeline.cache.format.shard_key`; planned by :mod:`pipeline.cache.shards`), so a re-run
writes only missing shards. Each worker writes its own shards, streaming them row group by row
group; nothing V-sized or cache-sized passes the driver.
"""

from __future__ import annotations

import json
import logging

import numpy as np

from drafters.target_weights import final_logit_softcap, load_frozen_head

from .. import storage
from ..config import CacheConfig
from ..target_features import CacheTarget, TargetFeatures, length_batches  # noqa: F401 (API)
from .check import check_head_agreement, head_agreement, read_first_row
from .format import shard_name
from .shards import pack_shards
from .writer import ShardWriter, read_sidecar, row_group_sizes, write_sidecar

logger = logging.getLogger(__name__)


class CacheWriterUDF(TargetFeatures):
    """Ray Data callable class: tokenizes conversations, runs the target, writes one shard per
    input row. Input columns: ``shard`` (int), ``path`` (shard base path without suffix),
    ``fingerprint`` and ``rows`` (JSON list of conversations). Output: one row per shard,
    ``shard``, ``path`` and ``summary`` (its sidecar as JSON).

    A shard's samples go to the target a row group at a time (at most ``rows_per_row_group``
    rows and ``row_group_bytes`` bytes, :func:`row_group_sizes`, known from the token counts
    before the forward): inside a row group they are forwarded in batches of similar length
    (:meth:`TargetFeatures.forward`), and the row group is written (streamed) before the next one
    is computed. Row order stays the conversations' order. A shard whose upload still fails after
    the store client's retries is rewritten from scratch with backoff
    (:func:`pipeline.storage.retry_transient`). The first shard of each split is checked before
    its sidecar marks it done: the target's LM head on its first row's cached final state must
    give the target's own logits (:mod:`pipeline.cache.check`); a failing shard keeps no sidecar,
    so a re-run writes it again.
    """

    def __init__(self, target: CacheTarget, cache: CacheConfig, storage_options: dict,
                 retry_base_delay_s: float = 2.0):
        super().__init__(target, cache)
        self.target_name = target.name_or_path
        self._head = None  # (LM head [V, H], soft cap): read at the first checked shard
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
        if path.rsplit("/", 1)[-1] == shard_name(0) and summary["rows"]:
            summary["head_check"] = self.check_head(storage.join(
                path.rsplit("/", 1)[0], summary["file"]))
        write_sidecar(path, summary, self.storage_options)
        return summary

    def check_head(self, shard_file: str) -> dict:
        """:func:`pipeline.cache.check.head_agreement` on the first row of ``shard_file``, read
        back from the store.

        Raises:
            CacheHeadMismatchError: the cached final state is not the LM head's input.
        """
        if self._head is None:
            config, _, head = load_frozen_head(self.target_name)
            self._head = (head, final_logit_softcap(config))
        row = read_first_row(shard_file, self.model.config.hidden_size, len(self.layer_ids),
                             self.storage_options)
        result = head_agreement(self.model, row, *self._head)
        check_head_agreement(result, shard_file, row["sample_id"])
        return result

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        summaries = {"shard": [], "path": [], "summary": []}
        for shard, path, fingerprint, rows_json in zip(batch["shard"], batch["path"],
                                                       batch["fingerprint"], batch["rows"]):
            path, convs = str(path), json.loads(rows_json)
            write = lambda: self.write_shard(path, convs, str(fingerprint))  # noqa: E731
            summary = (storage.retry_transient(write, what=f"cache shard {path}",
                                               base_delay_s=self.retry_base_delay_s)
                       if storage.is_url(path) else write())
            summaries["shard"].append(int(shard))
            summaries["path"].append(path)
            summaries["summary"].append(json.dumps(summary))
        return summaries


def run_cache(splits: dict[str, list[dict] | str], cache_dir: str, target: CacheTarget,
              cache: CacheConfig, storage_options: dict) -> dict[str, list[dict]]:
    """Write the missing shards of every split in one pass (one writer actor pool: an actor's
    start, which loads the target, is paid once, not once a split); return each split's shard
    summaries in shard order (splits without conversations are left out).

    The conversations are read as a Ray Data dataset (a generate output file is never loaded into
    the driver, which holds only the ids): a split's shards are its conversations in cache order
    (``pipeline.cache.format.shard_key``) cut every ``rows_per_shard``, packed one row per shard by a
    ``groupby``, fingerprinted there, and only shards without a sidecar of the same fingerprint go
    to the writer actors (:class:`CacheWriterUDF`; ``cache.forward_batch_tokens`` is its
    batched-forward budget, ``cache.rows_per_row_group`` and ``cache.row_group_bytes`` cap its row
    groups). The row-group caps are not part of a shard's fingerprint: they change the layout, not
    the rows, so a shard written with other caps is kept.

    Args:
        splits: split -> a JSONL file of conversations (``id``, ``messages``, ``domain``; local
            or s3://) or the conversations themselves; shards go under ``<cache_dir>/<split>/``.
        cache_dir: the cache's location (local or s3://).
        target: the target to forward; cache: the ``cache:`` config section.
    Raises:
        ValueError: a conversation id occurs twice in a split.
    """
    import ray
    from ray.data.expressions import col

    packed, num_shards = pack_shards(splits, cache_dir, target, cache)
    if packed is None:
        return {}
    # in the order the splits were given (the union's rows come in no fixed order)
    summaries: dict[str, dict[int, dict]] = {split: {} for split in splits if split in num_shards}
    todo: dict[str, tuple[str, int]] = {}  # path -> (split, shard)
    for row in packed.select_columns(["split", "shard", "path", "fingerprint"]).take_all():
        split, i, base = str(row["split"]), int(row["shard"]), str(row["path"])
        done = read_sidecar(base, storage_options)
        if done is not None:
            if done.get("fingerprint") == str(row["fingerprint"]):
                summaries[split][i] = done
                continue
            logger.warning("%s was written from other inputs or settings: rewriting it", base)
        todo[base] = (split, i)
    if todo:
        for split, n in num_shards.items():
            logger.info("cache %s: writing %d of %d shards", storage.join(cache_dir, split),
                        sum(s == split for s, _ in todo.values()), n)
        ds = packed.filter(expr=col("path").is_in(sorted(todo)))
        ds = ds.repartition(len(todo)).map_batches(
            CacheWriterUDF,
            fn_constructor_kwargs=dict(target=target, cache=cache,
                                       storage_options=storage_options),
            batch_size=1, compute=ray.data.ActorPoolStrategy(size=cache.num_actors),
            num_cpus=cache.cpus_per_actor,
            num_gpus=cache.gpus_per_actor or None, batch_format="numpy")
        for row in ds.iter_rows():
            split, i = todo[str(row["path"])]
            summaries[split][i] = json.loads(row["summary"])
    return {split: [shards[i] for i in range(num_shards[split])]
            for split, shards in summaries.items()}


def run_cache_split(conversations: list[dict] | str, cache_dir: str, split: str,
                    target: CacheTarget, cache: CacheConfig,
                    storage_options: dict) -> list[dict]:
    """:func:`run_cache` of one split: its shard summaries in shard order ([] without
    conversations)."""
    return run_cache({split: conversations}, cache_dir, target, cache,
                     storage_options).get(split, [])
