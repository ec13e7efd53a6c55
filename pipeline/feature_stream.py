"""Online and hybrid training data (``train.data_mode``): the target's features computed by a Ray
Data pipeline of target actors and streamed into the Ray Train workers, instead of read back from
the Parquet cache.

- *online*: every epoch, the generate output's conversations go (in a seeded order per epoch)
  through :class:`FeatureStreamUDF` actors, the cache stage's own tokenization and forward
  (:class:`pipeline.target_features.TargetFeatures`), and the rows stream to the trainers;
  nothing is stored.
- *hybrid*: the first epoch is the cache stage itself, shard by shard (:class:`HybridShardUDF`
  writes each shard and streams its row groups on to the trainers; a shard already written is
  read back, not recomputed); later epochs read the finished cache (``pipeline/train.py``).

A streamed row is a cache row (:data:`pipeline.cache_format.SCHEMA`) plus ``epoch`` and
``start_step`` (the optimizer step the stream was built for), so the workers decode it exactly
as they decode the cache. The stream is rebuilt by Ray Train at every worker-group start
(a dataset factory, :class:`TrainStream`): after a worker failure it begins at the newest
complete checkpoint's step, so no finished step's samples are computed again. The stream's
position is counted in samples: step ``s`` begins ``s * global_batch_size`` samples into the
concatenation of the epochs; a resumed stream begins at the first conversation of that
position's epoch order that was not yet consumed.

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
from .cache_writer import add_supervised_counts, read_sidecar, token_counts_dict
from .config import CacheConfig
from .target_features import CacheTarget, ConversationTokenizer, TargetFeatures

logger = logging.getLogger(__name__)

HELDOUT_EPOCH = -1  # the ``epoch`` of held-out rows (their anchors are drawn as the cache's are)


def read_conversation_lines(data: bytes) -> list[str]:
    """The JSON lines of a generate output, sorted by conversation id (the order of the cache's
    shards); blank and unreadable (torn) lines dropped."""
    keyed = []
    for line in data.decode("utf-8").splitlines():
        if not line.strip():
            continue
        try:
            keyed.append((str(json.loads(line)["id"]), line))
        except (json.JSONDecodeError, KeyError, TypeError):
            logger.warning("generate output: ignoring an unreadable line (%.60s...)", line)
    keyed.sort(key=lambda kv: kv[0])
    return [line for _, line in keyed]


class TokenScanUDF(ConversationTokenizer):
    """Ray Data callable class (tokenizer only): per conversation its ``id``, ``num_samples``,
    ``tokens``, ``supervised_tokens``, supervised-token counts (``counts``, JSON
    {token id: count}) and ``error`` ("" when it tokenized), as the cache stage would count it."""

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {k: [] for k in ("id", "num_samples", "tokens", "supervised_tokens", "counts",
                               "error")}
        for line in batch["text"]:
            conv = json.loads(str(line))
            try:
                samples = self.tokenize(conv)
                error = ""
            except ValueError as err:
                samples, error = [], f"{type(err).__name__}: {err}"
            records = [{"input_ids": np.asarray(s["input_ids"], dtype="<i4").tobytes(),
                        "loss_mask": np.asarray(s["loss_mask"], dtype=np.uint8).tobytes()}
                       for s in samples]
            out["id"].append(str(conv["id"]))
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
    """One split of the generate output as the trainers will see it: conversation ids in id order
    with their sample counts, the split's statistics in the form of a cache shard's summary
    (``rows``, ``tokens``, ``supervised_tokens``, ``supervised_token_counts``) and the
    conversations that produce no sample (``errors``: ``{id, stage, error}``)."""

    ids: list[str]
    samples_per_conversation: np.ndarray  # int64 [conversations], id order
    summary: dict
    errors: list[dict] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return int(self.summary["rows"])


def scan_split(path: str, target: CacheTarget, cache: CacheConfig) -> SplitScan:
    """Tokenize a generate output file (Ray Data, tokenizer-only tasks) and count its samples.

    Raises:
        ValueError: a conversation id occurs twice.
    """
    import ray

    from .cache import conversations_dataset

    rows = conversations_dataset(path).map_batches(
        TokenScanUDF, fn_constructor_kwargs={"target": target, "cache": cache},
        compute=ray.data.ActorPoolStrategy(size=cache.num_actors), num_cpus=cache.cpus_per_actor,
        batch_size=64, batch_format="numpy").take_all()
    rows.sort(key=lambda r: str(r["id"]))
    ids = [str(r["id"]) for r in rows]
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
    return SplitScan(ids, np.array([int(r["num_samples"]) for r in rows], dtype=np.int64),
                     summary, errors)


def epoch_order(seed: int, epoch: int, num_conversations: int) -> np.ndarray:
    """The conversations' order in one epoch of the online stream (indices into id order)."""
    return np.random.default_rng([seed, epoch, 7]).permutation(num_conversations)


def stream_start(samples_per_conversation: np.ndarray, seed: int, start_sample: int
                 ) -> int:
    """The stream position (``epoch * conversations + k``: the k-th conversation of that
    epoch's order) of the first conversation not yet consumed when ``start_sample`` samples have
    been, counting the epochs' samples one after another."""
    n = len(samples_per_conversation)
    per_epoch = int(samples_per_conversation.sum())
    epoch, within = divmod(start_sample, per_epoch)
    consumed = np.cumsum(samples_per_conversation[epoch_order(seed, epoch, n)])
    return epoch * n + int(np.searchsorted(consumed, within, side="right"))


def _positions(batch: dict[str, np.ndarray], first: int, num_conversations: int, seed: int
               ) -> dict[str, np.ndarray]:
    """Ray Data batch: stream offsets (``id`` from ``ray.data.range``) -> ``epoch`` and
    ``conversation`` (index in id order)."""
    pos = batch["id"].astype(np.int64) + first
    epochs = pos // num_conversations
    conv = np.empty_like(pos)
    for e in np.unique(epochs):
        sel = epochs == e
        conv[sel] = epoch_order(seed, int(e), num_conversations)[pos[sel] % num_conversations]
    return {"epoch": epochs, "conversation": conv}


class FeatureStreamUDF(TargetFeatures):
    """Ray Data callable class: conversations (``epoch``, ``conversation`` index in id order) ->
    their cache rows (:meth:`TargetFeatures.forward`) with ``epoch`` and ``start_step``.

    Args:
        conversations: the split's generate output as bytes (or an ObjectRef of them).
        start_step: written into every row (the workers check it against their resume step).
    """

    def __init__(self, target: CacheTarget, cache: CacheConfig, conversations, start_step: int):
        import ray

        super().__init__(target, cache)
        data = ray.get(conversations) if isinstance(conversations, ray.ObjectRef) else conversations
        self.lines = read_conversation_lines(data)
        self.start_step = start_step

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        samples, epochs, convs = [], [], []
        for epoch, conv in zip(batch["epoch"], batch["conversation"]):
            try:
                got = self.tokenize(json.loads(self.lines[int(conv)]))
            except ValueError:  # counted and reported by the scan (scan_split)
                continue
            samples += got
            epochs += [int(epoch)] * len(got)
            convs += [int(conv)] * len(got)
        return with_stream_columns(self.forward(samples), epochs, convs, self.start_step)


def with_stream_columns(table: pa.Table, epochs: list[int], conversations: list[int],
                        start_step: int) -> pa.Table:
    """A cache-row table plus the stream's ``epoch`` (int32), ``conversation`` (int64, index in
    id order; -1 when not known) and ``start_step`` (int64)."""
    n = table.num_rows
    table = table.append_column("epoch", pa.array(epochs, pa.int32()))
    table = table.append_column("conversation", pa.array(conversations, pa.int64()))
    return table.append_column("start_step", pa.array([start_step] * n, pa.int64()))


@dataclass
class TrainStream:
    """The online stream of one training run, as a dataset factory for ``TorchTrainer(datasets=
    ...)``: Ray Train calls it at every worker-group start (``ray.train.v2``). The first call
    starts at ``start_step`` (the checkpoint the driver resumes from, or 0); a later call (a
    restart after a worker failure) at the newest complete checkpoint of the run, which is the
    one the workers restore (``pipeline.train_state.resume_checkpoint``).

    Attributes:
        conversations: ObjectRef of the split's generate output (bytes).
        samples_per_conversation: int64 [conversations] in id order (:func:`scan_split`).
        total_steps, global_batch_size: the run's schedule; the stream covers it (plus an
            epoch, since a worker's equal share may drop a few rows).
    """

    conversations: object
    samples_per_conversation: np.ndarray
    target: CacheTarget
    cache: CacheConfig
    seed: int
    start_step: int
    total_steps: int
    global_batch_size: int
    checkpoints: tuple[str, str, dict]  # (Ray Train storage path, run name, storage options)
    calls: int = 0

    def __call__(self):
        step = self.start_step
        if self.calls:
            step = newest_checkpoint_step(*self.checkpoints, default=self.start_step)
        self.calls += 1
        return self.dataset(step)

    def dataset(self, step: int):
        """The stream from optimizer step ``step`` on (a lazy Ray Data dataset)."""
        import ray

        n = len(self.samples_per_conversation)
        per_epoch = int(self.samples_per_conversation.sum())
        first = stream_start(self.samples_per_conversation, self.seed,
                             step * self.global_batch_size)
        needed = self.total_steps * self.global_batch_size
        end = (-(-needed // per_epoch) + 1) * n
        logger.info("online stream from step %d: conversation position %d of %d", step, first,
                    end)
        return (ray.data.range(max(end - first, 1))
                .map_batches(_positions, fn_kwargs={"first": first, "num_conversations": n,
                                                    "seed": self.seed}, batch_format="numpy")
                .map_batches(FeatureStreamUDF, fn_constructor_kwargs={
                    "target": self.target, "cache": self.cache,
                    "conversations": self.conversations, "start_step": step},
                    batch_size=self.cache.rows_per_row_group,
                    compute=ray.data.ActorPoolStrategy(size=self.cache.num_actors),
                    num_cpus=self.cache.cpus_per_actor,
                    num_gpus=self.cache.gpus_per_actor or None, batch_format="numpy"))


def newest_checkpoint_step(storage_path: str, run_name: str, storage_options: dict,
                           default: int = 0) -> int:
    """The step of the run's newest complete checkpoint (``default`` when there is none)."""
    from .checkpoints import inspect_checkpoint, latest_checkpoint

    path = latest_checkpoint(storage_path, run_name, storage_options)
    return default if path is None else int(inspect_checkpoint(path, storage_options).step)


@dataclass
class HeldoutStream:
    """The held-out rows the workers evaluate on (dataset factory): the first ``eval_rows``
    samples of the held-out split in id order, the rows the offline path reads from the held-out
    cache."""

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
                    "conversations": self.conversations, "start_step": 0},
                    batch_size=self.cache.rows_per_row_group,
                    compute=ray.data.ActorPoolStrategy(size=1),
                    num_cpus=self.cache.cpus_per_actor,
                    num_gpus=self.cache.gpus_per_actor or None, batch_format="numpy"))


class HybridShardUDF:
    """Ray Data callable class (hybrid mode, epoch 0): one packed cache shard per input row (the
    cache stage's ``shard``, ``path``, ``fingerprint``, ``rows``) -> the shard's rows, a row group
    at a time, with ``epoch`` 0. A shard without a sidecar of the same fingerprint is written
    first (:class:`pipeline.cache.CacheWriterUDF`, retries included); the rows streamed on are
    read back from the written file, so training sees exactly the cached bytes and an
    interrupted run never computes a written shard again.
    """

    def __init__(self, target: CacheTarget, cache: CacheConfig, storage_options: dict):
        from .cache import CacheWriterUDF

        self.writer = CacheWriterUDF(target, cache, storage_options)
        self.storage_options = storage_options

    def __call__(self, batch: dict[str, np.ndarray]):
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
                    yield with_stream_columns(table, [0] * table.num_rows,
                                              [-1] * table.num_rows, 0)


def put_conversations(path: str, storage_options: dict):
    """The split's generate output as one bytes object in the object store (ObjectRef)."""
    import ray

    return ray.put(storage.read_bytes(path, storage_options))
