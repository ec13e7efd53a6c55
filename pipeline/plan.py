"""Size planner: what a pipeline config will produce and read, before anything runs.

    python -m pipeline.plan --config infra/configs/qwen3_4b.yaml --hidden-size 2560 --num-layers 36

Prints bytes per cached token ((m + 1) * H * 2 + 5, SPEC 1.4), the prompts the config selects, the
answer tokens their regeneration produces at most (and how long it takes at a given throughput), the
cache's total bytes, shard and file counts, the Parquet row-group size (rows and bytes, for a mean
sample and at ``cache.max_length``, within ``cache.rows_per_row_group`` and
``cache.row_group_bytes``), the time to write it once and to read it every epoch at
a given bandwidth, the training steps, the peak device memory of one worst-case training
micro-batch per worker (``pipeline/memory.py``) against ``--device-memory-gb``, and for
``train.data_mode`` online / hybrid the feature stream: the target-forward tokens (online: every
epoch), the host memory the stream holds, the producer rate that keeps the trainers busy
(``--train-step-s``) and the time per epoch of features (``--feature-tokens-per-s``). Tokens per sample
are taken from an existing cache manifest of the run when there is one, else from
``--tokens-per-sample`` (said so in the output). The memory line needs the target's full config:
loaded with ``AutoConfig`` from ``target.name_or_path``, or given as ``--target-config``
(a ``config.json``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from . import storage
from .config import ConfigError, load_config
from .memory import estimate_for_config, stream_budget
from .prompts import expand_sources, read_ids
from .run_layout import RunLayout

BYTES_PER_FEATURE = 2  # bf16 hidden states
BYTES_PER_TOKEN_IDS = 5  # int32 input id + uint8 loss mask
SIDECAR_FILES_PER_SHARD = 2  # <shard>.parquet and its <shard>.json completion marker


@dataclass
class Plan:
    """Everything the planner derives (bytes, seconds, counts)."""

    hidden_size: int
    context_layers: int
    bytes_per_token: int
    prompts: int
    train_rows: int
    heldout_rows: int
    tokens_per_sample: float
    tokens_per_sample_source: str
    total_tokens: float
    total_bytes: float
    shards: int
    files: int
    shard_bytes: float
    write_s: float
    read_s_per_epoch: float
    steps_per_epoch: int
    train_steps: int
    bandwidth_bytes_per_s: float
    memory: dict | None = None  # pipeline.memory.MemoryEstimate.as_dict(), bytes
    memory_note: str = ""  # why there is no memory estimate
    device_memory_bytes: float = 80e9
    answer_tokens_max: int = 0  # prompts x generate.sampling.max_new_tokens
    generate_tokens_per_s: float | None = None  # regeneration throughput, for the time line
    row_group_rows: int = 0  # rows of one row group of mean-sized samples
    row_group_bytes: float = 0.0  # its uncompressed bytes
    row_group_rows_at_max_length: int = 0  # the same with every sample at cache.max_length
    row_group_bytes_at_max_length: float = 0.0
    max_rows_per_row_group: int = 0  # cache.rows_per_row_group
    max_row_group_bytes: int = 0  # cache.row_group_bytes
    row_size_note: str = ""  # why a cache.max_length sample cannot be cached, if it cannot
    data_mode: str = "offline"  # train.data_mode
    stream: dict | None = None  # pipeline.memory.StreamBudget as a dict


def bytes_per_token(hidden_size: int, context_layers: int) -> int:
    """Cache bytes per token: m context layers + the last hidden state in bf16, plus ids and mask
    (SPEC 1.4)."""
    return (context_layers + 1) * hidden_size * BYTES_PER_FEATURE + BYTES_PER_TOKEN_IDS


def count_rows(path: str, storage_options: dict | None = None) -> int:
    """Rows of one prompt file (JSON Lines, gzip JSON Lines or Parquet), without validating them."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        with storage.get_fsspec(path, storage_options).open(path, "rb") as fh:
            return pq.ParquetFile(fh).metadata.num_rows
    with storage.get_fsspec(path, storage_options).open(path, "rb") as raw:
        fh = gzip.open(raw) if path.endswith(".gz") else raw
        return sum(1 for line in fh if line.strip())


def plan(cfg, hidden_size: int, num_layers: int, tokens_per_sample: float | None,
         bandwidth_gb_s: float, target_config=None, device_memory_gb: float = 80.0,
         generate_tokens_per_s: float | None = None, train_step_s: float | None = None,
         feature_tokens_per_s: float | None = None) -> Plan:
    """The plan for a validated ``PipelineConfig``.

    Args:
        hidden_size, num_layers: the target's H and decoder-layer count.
        tokens_per_sample: mean tokens per cached sample; None = from the run's cache manifest.
        bandwidth_gb_s: storage bandwidth in GB/s (10^9 bytes), for the time estimates.
        target_config: the target's Hugging Face config, for the memory estimate (None: none).
        device_memory_gb: one worker's device memory in GB (10^9 bytes).
        generate_tokens_per_s: generated tokens/s of the generate stage (all actors), for the
            regeneration time bound (None: no time line).
        train_step_s, feature_tokens_per_s: seconds per optimizer step and the target actors'
            forward tokens/s, for the feature-stream lines (:func:`pipeline.memory.stream_budget`).
    Raises:
        ValueError: no tokens_per_sample and no cache manifest to take it from.
    """
    # lazy: import cycle: train.data -> cache.format -> plan
    from .train.data import steps_per_epoch

    m = len(cfg.target.layer_ids) if cfg.target.layer_ids else cfg.target.num_context_layers
    per_token = bytes_per_token(hidden_size, m)
    prompts = 0
    for src in cfg.prompts.sources:
        rows = sum(count_rows(f, cfg.storage_options)
                   for f in expand_sources(storage.resolve(src.path), cfg.storage_options))
        prompts += min(rows, src.max_rows) if src.max_rows else rows
    if cfg.prompts.heldout_ids_from:  # an upper bound: held-out rows that a source's rows
        # (all of them, or its max_rows subsample) include are counted twice (the prompts stage
        # takes them out of the training split)

        heldout = len(read_ids(storage.resolve(cfg.prompts.heldout_ids_from),
                               cfg.storage_options))
        train_rows = prompts
        prompts += heldout
    else:
        heldout = int(round(prompts * cfg.prompts.heldout_fraction))
        train_rows = prompts - heldout
    source = "--tokens-per-sample"
    if tokens_per_sample is None:
        cache = cfg.cache.output or str(RunLayout(Path(storage.resolve(cfg.run_dir))).default_cache_dir)
        manifest_path = storage.join(storage.resolve(cache), "manifest.json")
        if not storage.exists(manifest_path, cfg.storage_options):
            raise ValueError("no cache manifest to take tokens per sample from: pass "
                             "--tokens-per-sample (e.g. prompt + answer tokens you expect)")
        splits = json.loads(storage.read_bytes(manifest_path, cfg.storage_options))["splits"]
        rows = sum(s["rows"] for s in splits.values())
        tokens_per_sample = sum(s["tokens"] for s in splits.values()) / max(rows, 1)
        source = f"measured in {manifest_path}"
    tokens_per_sample = min(tokens_per_sample, cfg.cache.max_length)
    total_tokens = prompts * tokens_per_sample
    total_bytes = total_tokens * per_token
    shards = (math.ceil(train_rows / cfg.cache.rows_per_shard)
              + math.ceil(heldout / cfg.cache.rows_per_shard))
    bandwidth = bandwidth_gb_s * 1e9
    per_epoch = steps_per_epoch(train_rows, cfg.train.global_batch_size)
    steps = per_epoch * cfg.train.num_epochs
    if cfg.train.max_steps:
        steps = min(steps, cfg.train.max_steps)
    memory, note = None, "needs the target's config (--target-config)"
    if target_config is not None:
        try:
            memory, note = estimate_for_config(cfg, target_config).as_dict(), ""
        except NotImplementedError as err:
            note = f"not modelled: {err}"

    stream = asdict(stream_budget(cfg, train_rows, tokens_per_sample, per_token, train_step_s,
                                  feature_tokens_per_s))
    return Plan(hidden_size, m, per_token, prompts, train_rows, heldout, tokens_per_sample, source,
                total_tokens, total_bytes, shards, shards * SIDECAR_FILES_PER_SHARD + 1,
                total_bytes / max(shards, 1), total_bytes / bandwidth,
                total_bytes * train_rows / max(prompts, 1) / bandwidth, per_epoch, steps, bandwidth,
                memory, note, device_memory_gb * 1e9,
                prompts * cfg.generate.sampling.max_new_tokens, generate_tokens_per_s,
                **_row_groups(cfg.cache, per_token, tokens_per_sample, hidden_size, m),
                data_mode=cfg.train.data_mode, stream=stream)


def _row_groups(cache, per_token: int, tokens_per_sample: float, hidden_size: int,
                context_layers: int) -> dict:
    """The :class:`Plan` fields of the row-group size: as the cache writer cuts row groups
    (``pipeline.cache.writer.row_group_sizes``) of samples all of the mean size, and all at
    ``cache.max_length``; bytes uncompressed."""
    # lazy: import cycle: cache.writer -> cache.format -> plan
    from .cache.writer import check_row_size, row_group_sizes

    def group(tokens: float) -> tuple[int, float]:
        row = round(tokens * per_token)
        rows = row_group_sizes([row] * cache.rows_per_row_group, cache.rows_per_row_group,
                               cache.row_group_bytes)[0]
        return rows, rows * row

    (rows, size), (rows_max, size_max) = group(tokens_per_sample), group(cache.max_length)
    try:
        check_row_size(cache.max_length, hidden_size, context_layers)
        note = ""
    except ValueError as err:
        note = str(err)
    return {"row_group_rows": rows, "row_group_bytes": size,
            "row_group_rows_at_max_length": rows_max, "row_group_bytes_at_max_length": size_max,
            "max_rows_per_row_group": cache.rows_per_row_group,
            "max_row_group_bytes": cache.row_group_bytes, "row_size_note": note}


def _human(n: float, unit: str = "B") -> str:
    for prefix in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000 or prefix == "P":
            return f"{n:,.1f} {prefix}{unit}"
        n /= 1000
    return f"{n:.1f} {unit}"


def _duration(s: float) -> str:
    return f"{s / 3600:,.1f} h" if s >= 3600 else f"{s / 60:,.1f} min" if s >= 60 else f"{s:.1f} s"


def render(p: Plan) -> str:
    rows = [
        ("bytes per cached token", f"{p.bytes_per_token:,} B = ({p.context_layers} + 1) x "
                                   f"{p.hidden_size} x 2 + 5"),
        ("prompts selected", f"{p.prompts:,} ({p.train_rows:,} train, {p.heldout_rows:,} held out)"),
        ("answer tokens (at most)", f"{_human(p.answer_tokens_max, 'tokens')} = prompts x "
                                    "generate.sampling.max_new_tokens" + (
            f"; regenerated in at most {_duration(p.answer_tokens_max / p.generate_tokens_per_s)} "
            f"at {p.generate_tokens_per_s:,.0f} tokens/s" if p.generate_tokens_per_s else "")),
        ("tokens per sample", f"{p.tokens_per_sample:,.0f} ({p.tokens_per_sample_source})"),
        ("cached tokens", _human(p.total_tokens, "tokens")),
        ("cache size", _human(p.total_bytes)),
        ("shards / files", f"{p.shards:,} shards of ~{_human(p.shard_bytes)}, {p.files:,} files "
                           "(parquet + json marker each, and the manifest)"),
        ("row groups", f"{p.row_group_rows:,} rows of ~{_human(p.row_group_bytes)} (mean "
                       f"sample), {p.row_group_rows_at_max_length:,} of "
                       f"{_human(p.row_group_bytes_at_max_length)} at cache.max_length; at most "
                       f"{p.max_rows_per_row_group:,} rows and {_human(p.max_row_group_bytes)}"
                       + (f"; error: {p.row_size_note}" if p.row_size_note else "")),
        (f"write once at {_human(p.bandwidth_bytes_per_s)}/s", _duration(p.write_s)),
        (f"read per epoch at {_human(p.bandwidth_bytes_per_s)}/s", _duration(p.read_s_per_epoch)),
        ("optimizer steps", f"{p.train_steps:,} ({p.steps_per_epoch:,} per epoch)"),
        ("peak memory per worker", _memory_line(p)),
        *_stream_lines(p),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _stream_lines(p: Plan) -> list[tuple[str, str]]:
    """The feature stream of online / hybrid training, and what online costs against the cache."""
    st = p.stream
    forward = (f"{_human(st['forward_tokens'], 'tokens')}; online recomputes "
               f"{_human(st['extra_forward_tokens'], 'tokens')} more than the cache's one pass"
               if p.data_mode == "online" else
               f"{_human(st['forward_tokens'], 'tokens')} (each sample once)")
    lines = [("train.data_mode", p.data_mode + (
        f": stores nothing (the cache would be {_human(p.total_bytes)})" if p.data_mode == "online"
        else f": stores the cache ({_human(p.total_bytes)})")),
        ("target forward tokens", forward)]
    if p.data_mode == "offline":
        return lines
    lines.append(("stream in flight (host)", f"at most {_human(st['bytes_in_flight'])} "
                  "(train.stream_object_store_gib + each trainer's prefetch and shuffle rows)"))
    if st["feature_tokens_per_s_needed"] is not None:
        lines.append(("feature rate to keep trainers busy",
                      f"{st['feature_tokens_per_s_needed']:,.0f} tokens/s (--train-step-s)"))
    if st["epoch_forward_s"] is not None:
        lines.append(("one epoch of features", f"{_duration(st['epoch_forward_s'])} at "
                      "--feature-tokens-per-s"))
    return lines


def _memory_line(p: Plan) -> str:
    if p.memory is None:
        return p.memory_note
    mem = p.memory
    share = mem["total"] / p.device_memory_bytes
    return (f"{_human(mem['total'])} = model states {_human(mem['model_states'])} + frozen "
            f"embedding/head {_human(mem['frozen'])} + activations {_human(mem['activations'])} "
            f"(peak: {mem['peak_moment']}); worst-case micro-batch, {share:.0%} of "
            f"{_human(p.device_memory_bytes)}")


def _target_config(cfg, config_json: str | None = None):
    """The target's Hugging Face config: from ``config_json`` when given, else ``AutoConfig``
    of ``target.name_or_path``; None when it cannot be loaded here."""
    from transformers import AutoConfig

    if config_json:  # a file path: AutoConfig picks the class from its model_type
        return AutoConfig.from_pretrained(config_json)
    name = cfg.target.name_or_path
    if name.startswith((".", "/", "~")):
        name = storage.resolve(name)
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Cache and training size of a pipeline config.")
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    parser.add_argument("--hidden-size", type=int, default=None,
                        help="the target's H (default: its config, when it can be loaded)")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--tokens-per-sample", type=float, default=None,
                        help="mean prompt + answer tokens per sample (default: the run's manifest)")
    parser.add_argument("--bandwidth-gb-s", type=float, default=1.0,
                        help="storage bandwidth in GB/s for the time estimates")
    parser.add_argument("--target-config", default=None, metavar="CONFIG_JSON",
                        help="the target's Hugging Face config.json (default: loaded from "
                             "target.name_or_path when possible); needed for the memory line")
    parser.add_argument("--device-memory-gb", type=float, default=80.0,
                        help="one worker's device memory in GB, for the memory line")
    parser.add_argument("--generate-tokens-per-s", type=float, default=None,
                        help="generated tokens/s of the generate stage (e.g. from "
                             "benchmarks/results/gen_throughput/2026-12-02_unrecorded.md), for the regeneration time")
    parser.add_argument("--train-step-s", type=float, default=None,
                        help="seconds per optimizer step (benchmarks/results/train_throughput/2026-11-30_unrecorded.md), "
                             "for the feature rate online training needs")
    parser.add_argument("--feature-tokens-per-s", type=float, default=None,
                        help="the target actors' forward tokens/s together, for the time one "
                             "epoch of streamed features takes")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)

    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    hidden, layers = args.hidden_size, args.num_layers
    try:
        target_config = _target_config(cfg, args.target_config)
    except (OSError, ValueError) as err:
        print(f"error: --target-config {args.target_config}: {err}", file=sys.stderr)
        return 2
    if target_config is not None:
        hidden = hidden or target_config.hidden_size
        layers = layers or target_config.num_hidden_layers
    if hidden is None:
        print(f"error: cannot load the config of target {cfg.target.name_or_path!r} here: pass "
              "--hidden-size and --num-layers", file=sys.stderr)
        return 2
    try:
        result = plan(cfg, hidden, layers, args.tokens_per_sample, args.bandwidth_gb_s,
                      target_config, args.device_memory_gb, args.generate_tokens_per_s,
                      args.train_step_s, args.feature_tokens_per_s)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(result), indent=1) if args.json else render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
