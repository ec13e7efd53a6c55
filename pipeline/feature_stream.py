"""Online and hybrid training data (``train.data_mode``): the target's features computed by a Ray
Data pipeline of target actors and streamed into the Ray Train workers, instead of read back from
the Parquet cache.

- *online*: every epoch, the generate output's conversations go (in a seeded order per epoch)
  through :class:`FeatureStreamUDF` actors, the cache stage's own tokenization and forward
  (:class:`pipeline.target_features.TargetFeatures`), and the rows stream to the trainers;
  nothing is stored.
- *hybrid*: the first epoch is the cache stage itself, shard by shard (:class:`HybridShardUDF`
  writes each shard and streams its row groups on to the trainers; a shard already written is
  read back, not recomputed); later epochs read the finished cache (``pipeline/train/modes.py``).

A streamed row is a cache row (:data:`pipeline.cache.format.SCHEMA`) plus ``epoch`` and
``conversation`` (its index in cache order, :func:`pipeline.cache.format.shard_key`), cut into
tables as the cache writer cuts row groups (``cache.rows_per_row_group``,
``cache.row_group_bytes``), so the workers decode it exactly as they decode the cache. The streams
are dataset factories (:class:`TrainStream`, :class:`HybridStream`) that Ray Train calls at every
worker-group start: each reads the consumed-sample record of the checkpoint the workers continue
from (:mod:`pipeline.stream_state`) and leaves those samples out, so no sample of an epoch is lost
or trained on twice across restarts.

The driver never holds the target; it holds the conversations of the split as one bytes object in
the object store (what the actors read) and per conversation only its id and sample count
(:func:`scan_split`, a tokenizer-only Ray Data pass that also yields the manifest's statistics).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from . import storage
from .cache.format import parse_conversation_line, shard_key
from .cache.shards import conversations_dataset
from .cache.stage import CacheWriterUDF
from .cache.writer import add_supervised_counts, read_sidecar, row_group_sizes, token_counts_dict
from .checkpoints import latest_checkpoint
from .config import CacheConfig
from .stream_state import StreamState, read_state
from .target_features import CacheTarget, ConversationTokenizer, TargetFeatures
from .train.data import HELDOUT_EPOCH

logger = logging.getLogger(__name__)


def read_conversation_lines(data: bytes) -> list[str]:
    """The JSON lines of a generate output in cache order (:func:`shard_key`); blank and
    unreadable (torn) lines dropped."""
    keyed = []
    for line in data.decode("utf-8").splitlines():
        parsed = parse_conversation_line(line)
        if parsed is not None:
            keyed.append((shard_key(parsed[0]), line))
    keyed.sort(key=lambda kv: kv[0])
    return [line for _, line in keyed]


def sample_ids(conversation_id: str, num_samples: int) -> list[str]:
    """The cache's sample ids of a conversation (``TargetFeatures.tokenize``)."""
    if num_samples == 1:
        return [conversation_id]
    return [f"{conversation_id}#{k}" for k in range(num_samples)]


class TokenScanUDF(ConversationTokenizer):
    """Ray Data callable class (tokenizer only): per conversation its ``id``, ``num_samples``,
    ``tokens``, ``supervised_tokens``, supervised-token counts (``counts``, JSON
    {token id: count}) and ``error`` ("" when it tokenized), as the cache stage would count it;
    unreadable lines are left out as the cache stage leaves them out."""

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {k: [] for k in ("id", "num_samples", "tokens", "supervised_tokens", "counts",
                               "error")}
        for line in batch["text"]:
            parsed = parse_conversation_line(str(line))
            if parsed is None:
                continue
            try:
                samples, error = self.tokenize(parsed[1]), ""
            except ValueError as err:
                samples, error = [], f"{type(err).__name__}: {err}"
            records = [{"input_ids": np.asarray(s["input_ids"], dtype="<i4").tobytes(),
                        "loss_mask": np.asarray(s["loss_mask"], dtype=np.uint8).tobytes()}
                       for s in samples]
            out["id"].append(parsed[0])
            out["num_samples"].append(len(samples))
            out["tokens"].append(sum(len(s["input_ids"]) for s in samples))
            out["supervised_tokens"].append(sum(sum(s["loss_mask"]) for s in samples))
            out["counts"].append(json.dumps(token_counts_dict(
                add_supervised_counts(np.zeros(0, dtype=np.int64), records))))
            out["error"].append(error)
        return {k: np.array(v, dtype=object if k in ("id", "counts", "error") else np.int64)
                for k, v in out.items()}


@dataclass
class SplitScan:
    """One split of the generate output as the trainers will see it: conversation ids in cache
    order with their sample counts, the split's statistics in the form of a cache shard's summary
    (``rows``, ``tokens``, ``supervised_tokens``, ``supervised_token_counts``) and the
    conversations that produce no sample (``errors``: ``{id, stage, error}``)."""

    ids: list[str]
    samples_per_conversation: np.ndarray  # int64 [conversations], cache order
    summary: dict
    errors: list[dict] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return int(self.summary["rows"])


def scan_split(path: str, target: CacheTarget, cache: CacheConfig) -> SplitScan:
    """Tokenize a generate output file (Ray Data, tokenizer-only actors) and count its samples.

    Raises:
        ValueError: a conversation id occurs twice.
    """
    import ray

    rows = conversations_dataset(path).map_batches(
        TokenScanUDF, fn_constructor_kwargs={"target": target, "cache": cache},
        compute=ray.data.ActorPoolStrategy(size=cache.num_actors), num_cpus=cache.cpus_per_actor,
        batch_size=64, batch_format="numpy").take_all()
    rows.sort(key=lambda r: shard_key(str(r["id"])))
    ids = sorted(str(r["id"]) for r in rows)
    dup = next((a for a, b in zip(ids, ids[1:]) if a == b), None)
    if dup is not None:
        raise ValueError(f"conversation id {dup!r} occurs more than once in {path}")
    counts: dict[str, int] = {}
    for r in rows:
        for t, c in json.loads(str(r["counts"])).items():
            counts[t] = counts.get(t, 0) + c
    summary = {"rows": int(sum(int(r["num_samples"]) for r in rows)),
               "tokens": int(sum(int(r["tokens"]) for r in rows)),
               "supervised_tokens": int(sum(int(r["supervised_tokens"]) for r in rows)),
               "supervised_token_counts": counts}
    errors = [{"id": str(r["id"]), "stage": "stream", "error": str(r["error"])}
              for r in rows if str(r["error"])]
    return SplitScan([str(r["id"]) for r in rows],
                     np.array([int(r["num_samples"]) for r in rows], dtype=np.int64),
                     summary, errors)


def epoch_order(seed: int, epoch: int, num_conversations: int) -> np.ndarray:
    """The conversations' order in one epoch of the online stream (indices into cache order)."""
    return np.random.default_rng([seed, epoch, 7]).permutation(num_conversations)


def _positions(batch: dict[str, np.ndarray], first_epoch: int, num_conversations: int, seed: int,
               skip: dict[int, np.ndarray]) -> dict[str, np.ndarray]:
    """Ray Data batch: stream offsets (``id`` from ``ray.data.range``, counted from
    ``first_epoch``'s start) -> ``epoch`` and ``conversation`` (index in cache order), without
    the conversations in ``skip`` ({epoch: sorted indices}: every sample already trained on)."""
    pos = batch["id"].astype(np.int64) + first_epoch * num_conversations
    epochs = pos // num_conversations
    conv = np.empty_like(pos)
    for e in np.unique(epochs):
        sel = epochs == e
        conv[sel] = epoch_order(seed, int(e), num_conversations)[pos[sel] % num_conversations]
    keep = np.ones(len(pos), dtype=bool)
    for e, done in skip.items():
        sel = epochs == e
        keep[sel] = ~np.isin(conv[sel], done)
    return {"epoch": epochs[keep], "conversation": conv[keep]}


class FeatureStreamUDF(TargetFeatures):
    """Ray Data callable class: conversations (``epoch``, ``conversation`` index in cache order)
    -> their cache rows (:meth:`TargetFeatures.forward`) with ``epoch`` and ``conversation``, one
    table per row group as the cache writer would cut it; samples already trained on
    (``consumed``: {epoch: sample ids}) are left out.

    Args:
        conversations: the split's generate output as bytes (or an ObjectRef of them).
    """

    def __init__(self, target: CacheTarget, cache: CacheConfig, conversations,
                 consumed: dict[int, set[str]] | None = None):
        import ray

        super().__init__(target, cache)
        data = ray.get(conversations) if isinstance(conversations, ray.ObjectRef) else conversations
        self.lines = read_conversation_lines(data)
        self.consumed = consumed or {}
        self.rows_per_row_group, self.row_group_bytes = (cache.rows_per_row_group,
                                                         cache.row_group_bytes)

    def __call__(self, batch: dict[str, np.ndarray]):
        samples, epochs, convs = [], [], []
        for epoch, conv in zip(batch["epoch"], batch["conversation"]):
            try:
                got = self.tokenize(json.loads(self.lines[int(conv)]))
            except ValueError:  # counted and reported by the scan (scan_split)
                continue
            done = self.consumed.get(int(epoch), ())
            got = [s for s in got if s["sample_id"] not in done]
            samples += got
            epochs += [int(epoch)] * len(got)
            convs += [int(conv)] * len(got)
        start = 0
        for n in row_group_sizes([len(s["input_ids"]) * self.bytes_per_token for s in samples],
                                 self.rows_per_row_group, self.row_group_bytes):
            yield with_stream_columns(self.forward(samples[start:start + n]),
                                      epochs[start:start + n], convs[start:start + n])
            start += n


def with_stream_columns(table: pa.Table, epochs: list[int], conversations: list[int]
                        ) -> pa.Table:
    """A cache-row table plus the stream's ``epoch`` (int32) and ``conversation`` (int64, index
    in cache order; -1 when not known)."""
    table = table.append_column("epoch", pa.array(epochs, pa.int32()))
    return table.append_column("conversation", pa.array(conversations, pa.int64()))


@dataclass
class Checkpoints:
    """Where a run's checkpoints are, and the one the driver starts from."""

    storage_path: str  # Ray Train's storage path
    run_name: str
    storage_options: dict
    resume: str | None  # the driver's choice (pipeline.train.driver.run_train), None: step 0
    fit_id: str | None = None  # the run_train call's id, in its checkpoints

    def current(self) -> str | None:
        """The checkpoint a starting worker group continues from, as the workers choose it
        (``pipeline.checkpoints.restore_choice``): this ``run_train`` call's newest complete
        one after a restart, the driver's choice at the start."""
        if self.fit_id is not None:
            own = latest_checkpoint(self.storage_path, self.run_name, self.storage_options,
                                    fit_id=self.fit_id)
            if own is not None:
                return own
        return self.resume


@dataclass
class TrainStream:
    """The online stream of one training run, as a dataset factory for ``TorchTrainer(datasets=
    ...)`` (Ray Train calls it at every worker-group start, ``ray.train.v2``): from the oldest
    epoch with samples left in the checkpoint's record on, without the samples it lists.

    Attributes:
        conversations: ObjectRef of the split's generate output (bytes).
        scan: the split's :class:`SplitScan` (ids and sample counts in cache order).
        total_steps, global_batch_size: the run's schedule; the stream covers it plus an epoch
            (a worker's equal share may drop a few rows).
    """

    conversations: object
    scan: SplitScan
    target: CacheTarget
    cache: CacheConfig
    seed: int
    total_steps: int
    global_batch_size: int
    checkpoints: Checkpoints

    def __call__(self):
        return self.dataset(read_state(self.checkpoints.current(), self.scan.rows,
                                       self.checkpoints.storage_options, require=True))

    def dataset(self, state: StreamState):
        """The stream after what ``state`` records as trained on (a lazy Ray Data dataset)."""
        import ray

        n, rows = len(self.scan.ids), self.scan.rows
        first = state.first_open_epoch()
        end = max(first + 1, -(-self.total_steps * self.global_batch_size // rows) + 1)
        skip = {e: self._fully_consumed(ids) for e, ids in state.consumed.items()}
        # an epoch that completed while an earlier one was still open: nothing of it again
        skip.update({e: np.arange(n) for e in state.distinct if e > first and state.complete(e)})
        logger.info("online stream: epochs %d to %d, %d samples already trained on left out",
                    first, end - 1, sum(len(ids) for ids in state.consumed.values()))
        return (ray.data.range((end - first) * n)
                .map_batches(_positions, fn_kwargs={"first_epoch": first, "num_conversations": n,
                                                    "seed": self.seed, "skip": skip},
                             batch_format="numpy")
                .map_batches(FeatureStreamUDF, fn_constructor_kwargs={
                    "target": self.target, "cache": self.cache,
                    "conversations": self.conversations, "consumed": state.consumed},
                    batch_size=self.cache.rows_per_row_group,
                    compute=ray.data.ActorPoolStrategy(size=self.cache.num_actors),
                    num_cpus=self.cache.cpus_per_actor,
                    num_gpus=self.cache.gpus_per_actor or None, batch_format="numpy"))

    def _fully_consumed(self, consumed: set[str]) -> np.ndarray:
        """Sorted indices of the conversations all of whose samples are in ``consumed``."""
        return np.array([i for i, (cid, k) in enumerate(zip(self.scan.ids,
                                                             self.scan.samples_per_conversation))
                         if k and all(s in consumed for s in sample_ids(cid, int(k)))],
                        dtype=np.int64)


@dataclass
class HeldoutStream:
    """The held-out rows the workers evaluate on (dataset factory): the first ``eval_rows``
    samples of the held-out split in cache order, the rows the offline path reads from the
    held-out cache."""

    conversations: object
    samples_per_conversation: np.ndarray
    target: CacheTarget
    cache: CacheConfig
    eval_rows: int

    def __call__(self):
        import ray

        cum = np.cumsum(self.samples_per_conversation)
        k = min(int(np.searchsorted(cum, self.eval_rows, side="left")) + 1, len(cum))
        return (ray.data.range(k)
                .map_batches(lambda b: {"epoch": np.full(len(b["id"]), HELDOUT_EPOCH),
                                        "conversation": b["id"].astype(np.int64)},
                             batch_format="numpy")
                .map_batches(FeatureStreamUDF, fn_constructor_kwargs={
                    "target": self.target, "cache": self.cache,
                    "conversations": self.conversations},
                    batch_size=self.cache.rows_per_row_group,
                    compute=ray.data.ActorPoolStrategy(size=1),
                    num_cpus=self.cache.cpus_per_actor,
                    num_gpus=self.cache.gpus_per_actor or None, batch_format="numpy"))


class HybridShardUDF:
    """Ray Data callable class (hybrid mode, epoch 0): one packed cache shard per input row (the
    cache stage's ``shard``, ``path``, ``fingerprint``, ``rows``) -> the shard's rows, a row group
    at a time, with ``epoch`` 0, less the samples already trained on (``consumed``). A shard
    without a sidecar of the same fingerprint is written first (:class:`pipeline.cache.stage.
    CacheWriterUDF`, retries included); the rows streamed on are read back from the written file,
    so training sees exactly the cached bytes and an interrupted run never computes a written
    shard again.
    """

    def __init__(self, target: CacheTarget, cache: CacheConfig, storage_options: dict,
                 consumed: set[str] | None = None):
        self.writer = CacheWriterUDF(target, cache, storage_options)
        self.storage_options = storage_options
        self.consumed = pa.array(sorted(consumed or ()), pa.string())  # built once

    def __call__(self, batch: dict[str, np.ndarray]):
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        for shard, path, fingerprint, rows_json in zip(batch["shard"], batch["path"],
                                                       batch["fingerprint"], batch["rows"]):
            path = str(path)
            done = read_sidecar(path, self.storage_options)
            if done is None or done.get("fingerprint") != str(fingerprint):
                self.writer({"shard": [shard], "path": [path], "fingerprint": [fingerprint],
                             "rows": [rows_json]})
            fs, fs_path = storage.get_arrow_fs(path + ".parquet", self.storage_options)
            with fs.open_input_file(fs_path) as fh:
                parquet = pq.ParquetFile(fh)
                for g in range(parquet.num_row_groups):
                    table = parquet.read_row_group(g)
                    if len(self.consumed):
                        table = table.filter(pc.invert(pc.is_in(table.column("sample_id"),
                                                                value_set=self.consumed)))
                    if table.num_rows:
                        yield with_stream_columns(table, [0] * table.num_rows,
                                                  [-1] * table.num_rows)


@dataclass
class HybridStream:
    """Hybrid's first epoch as a dataset factory: the packed shards
    (``pipeline.cache.shards.pack_shards``) in a seeded order through :class:`HybridShardUDF`,
    less what the checkpoint the workers continue from records as trained on."""

    packed: object  # a materialized Ray Data dataset, one row per shard
    rows: int  # samples of the epoch
    target: CacheTarget
    cache: CacheConfig
    seed: int
    checkpoints: Checkpoints

    def __call__(self):
        import ray

        state = read_state(self.checkpoints.current(), self.rows,
                           self.checkpoints.storage_options, require=True)
        c = self.cache
        return self.packed.random_shuffle(seed=self.seed).map_batches(
            HybridShardUDF, fn_constructor_kwargs={
                "target": self.target, "cache": c,
                "storage_options": self.checkpoints.storage_options,
                "consumed": state.consumed.get(0, set())},
            batch_size=1, compute=ray.data.ActorPoolStrategy(size=c.num_actors),
            num_cpus=c.cpus_per_actor, num_gpus=c.gpus_per_actor or None, batch_format="numpy")


def put_conversations(path: str, storage_options: dict):
    """The split's generate output as one bytes object in the object store (ObjectRef)."""
    import ray

    return ray.put(storage.read_bytes(path, storage_options))
