"""Target-cache I/O throughput: the training reader and the cache writer against raw pyarrow on
the same shards and store, on a local directory and on a moto S3 server (127.0.0.1, started here
in a child process), with the hidden-state columns zstd-compressed or not.

Data: a synthetic cache at SmolLM2-135M shapes: H = 576, 5 context layers, 256-384 tokens per row
(6,917 B/token, ~2 MB per row), bf16 features drawn from a Gaussian with log-normal per-channel
scales (zstd shrinks them to ~0.80 of their size, as it does real SmolLM2 activations).

Arms, alternating (ours, raw, ours, raw, ...) for ``--repeats`` rounds; the ratio is of the medians:

- read, ours: ``CacheRowIndex`` + ``CacheRowReader.prefetch`` over one epoch's plan (one worker,
  micro-batches of 4, prefetch depth as in training), every row decoded to torch tensors;
- read, raw: ``pq.read_table`` of each shard through the same filesystem, nothing decoded;
- write, ours: ``pipeline.cache.writer.ShardWriter`` per shard, as the cache actors use it (rows as an
  Arrow table): streamed row groups, sha256, atomic commit (fsync + rename locally, multipart
  completion on S3), then the sidecar;
- write, raw: ``pq.write_table`` of the same Arrow tables with the same Parquet options to the
  same store, a local file fsync'ed after it (both arms leave the bytes on disk); locally a
  ``raw_no_fsync`` arm (page cache only) is reported for reference.

Bytes/s count the cache payload (tokens x bytes_per_token of SPEC 1.4), the same for every arm;
CPU s/GB is this process's CPU time (all threads) per GB of payload. Writes
``benchmarks/results/cache_io/<date>_<machine class>.{md,json}``.

    .venv/bin/python benchmarks/cache_io.py [--rows 96] [--repeats 4]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.machine import describe as describe_machine, machine as machine_fields  # noqa: E402,I001
from benchmarks.machine import OUT_HELP, result_stem  # noqa: E402

H, LAYERS, VOCAB = 576, [1, 8, 15, 22, 27], 49152
BYTES_PER_TOKEN = (len(LAYERS) + 1) * H * 2 + 5
ROWS_PER_SHARD, ROWS_PER_GROUP = 32, 8
MICRO_BATCH = 4


def synthetic_records(n: int, seed: int = 0) -> list[dict]:
    """``n`` cache rows of 256-384 tokens (see the module docstring)."""
    import numpy as np
    import torch

    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    width = (len(LAYERS) + 1) * H
    scale = torch.exp(torch.randn(width, generator=g) * 0.7)  # per-channel, like real activations
    rows = []
    for i in range(n):
        t = int(rng.integers(256, 385))
        feats = (torch.randn(t, width, generator=g) * scale).to(torch.bfloat16)
        ctx, last = feats[:, :len(LAYERS) * H], feats[:, len(LAYERS) * H:]
        mask = np.zeros(t, dtype=np.uint8)
        mask[t // 4:] = 1
        rows.append({"sample_id": f"r{i:05d}", "domain": "synthetic", "num_tokens": t,
                     "input_ids": rng.integers(0, VOCAB, t, dtype="<i4").tobytes(),
                     "loss_mask": mask.tobytes(),
                     "context_hidden": ctx.contiguous().view(torch.int16).numpy().tobytes(),
                     "last_hidden": last.contiguous().view(torch.int16).numpy().tobytes()})
    return rows


def parquet_options(codec: str) -> dict:
    """The writer's Parquet options with the hidden-state columns compressed by ``codec``."""
    from pipeline.cache.format import SCHEMA
    from pipeline.cache.writer import PARQUET_OPTIONS

    compression = {c: ("zstd" if c not in ("context_hidden", "last_hidden") else codec)
                   for c in SCHEMA.names}
    return {**PARQUET_OPTIONS, "compression": compression}


def shards_of(records: list[dict]) -> list[list[dict]]:
    return [records[i:i + ROWS_PER_SHARD] for i in range(0, len(records), ROWS_PER_SHARD)]


def write_ours(split_dir: str, tables: list, so: dict, options: dict) -> int:
    """The project's writer (``ShardWriter``, as the cache actors use it): each shard's rows
    streamed as row groups, sha256, atomic commit, then the sidecar; returns tokens written."""
    from pipeline import storage
    from pipeline.cache.format import shard_name
    from pipeline.cache.writer import ShardWriter, write_sidecar

    tokens = 0
    for k, table in enumerate(tables):
        base = storage.join(split_dir, shard_name(k))
        with ShardWriter(base, so, ROWS_PER_GROUP, options) as writer:
            writer.write_table(table)
            summary = writer.close()
        write_sidecar(base, summary, so)
        tokens += summary["tokens"]
    return tokens


def write_raw(split_dir: str, tables: list, so: dict, options: dict, sync: bool = True) -> None:
    """``pq.write_table`` of each shard's Arrow table through the same filesystem; a local file
    is then fsync'ed (``sync``), as ours are, so that both leave the bytes in the store."""
    import pyarrow.parquet as pq

    from pipeline import storage
    from pipeline.cache.format import shard_name

    fs, base = storage.get_arrow_fs(split_dir, so)
    local = not storage.is_url(split_dir)
    if local:
        Path(base).mkdir(parents=True, exist_ok=True)
    for k, table in enumerate(tables):
        path = f"{base}/{shard_name(k)}.parquet"
        pq.write_table(table, path, filesystem=fs, row_group_size=ROWS_PER_GROUP, **options)
        if local and sync:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def remove(path: str, so: dict) -> None:
    from pipeline import storage

    fs = storage.get_fsspec(path, so)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def write_cache(cache_dir: str, records: list[dict], so: dict, options: dict) -> dict:
    """A cache written by the project's writer; returns the manifest (also written)."""
    from pipeline import storage
    from pipeline.cache.format import build_manifest, shard_name
    from pipeline.cache.writer import write_shard

    shards = [write_shard(storage.join(cache_dir, "train", shard_name(k)), rows,
                          rows_per_row_group=ROWS_PER_GROUP, storage_options=so,
                          extra={"errors": []}, parquet_options=options)
              for k, rows in enumerate(shards_of(records))]
    manifest = build_manifest(target="synthetic", revision=None, layer_ids=LAYERS, hidden_size=H,
                              vocab_size=VOCAB, template_sha256="-", template_kwargs={},
                              max_length=4096, splits={"train": shards})
    storage.write_bytes_atomic(storage.join(cache_dir, "manifest.json"),
                               json.dumps(manifest).encode(), so)
    return manifest


def read_ours(cache_dir: str, manifest: dict, so: dict) -> int:
    """One epoch through the training reader; returns tokens read."""
    from pipeline.train.sources import PREFETCH_MICRO_BATCHES
    from pipeline.train.data import CacheRowIndex, CacheRowReader, steps_per_epoch, worker_plan

    index = CacheRowIndex(cache_dir, manifest, "train", so)
    steps = steps_per_epoch(index.num_rows, MICRO_BATCH)
    tokens = 0
    with CacheRowReader(index, H, len(LAYERS)) as reader:
        plan = worker_plan(index, 0, 0, steps, steps, MICRO_BATCH, MICRO_BATCH, 0, 1)
        for _, samples in reader.prefetch(plan, depth=PREFETCH_MICRO_BATCHES):
            tokens += sum(s["input_ids"].numel() for s in samples)
    return tokens


def read_raw(cache_dir: str, manifest: dict, so: dict) -> int:
    """``pq.read_table`` of every shard through the same filesystem; returns tokens read."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from pipeline import storage

    fs, base = storage.get_arrow_fs(storage.join(cache_dir, "train"), so)
    tokens = 0
    for shard in manifest["splits"]["train"]["shards"]:
        table = pq.read_table(f"{base}/{shard['file']}", filesystem=fs)
        tokens += pc.sum(table.column("num_tokens")).as_py()
    return tokens


def alternate(arms: dict, repeats: int) -> dict[str, list[tuple[float, float, int]]]:
    """Run the arms in turn ``repeats`` times; ``arms``: {name: (untimed setup or None, timed fn
    returning tokens)}, after one untimed warm-up run of each. Returns {arm: [(wall s, CPU s of
    this process, tokens)]}. CPU seconds
    (all threads) are less sensitive to other load on the machine than wall time."""
    out = {name: [] for name in arms}
    for setup, fn in arms.values():  # warm-up (imports, allocator, page cache), not timed
        if setup:
            setup()
        fn()
    for _ in range(repeats):
        for name, (setup, fn) in arms.items():
            if setup:
                setup()
            start, cpu = time.perf_counter(), time.process_time()
            tokens = fn()
            out[name].append((time.perf_counter() - start, time.process_time() - cpu, tokens))
    return out


def summarize(store: str, direction: str, timings: dict, extra: dict) -> dict:
    ours_tps = statistics.median(t / s for s, _, t in timings["ours"])
    raw_tps = statistics.median(t / s for s, _, t in timings["raw"])
    cpu_per_gb = {k: statistics.median(c / (t * BYTES_PER_TOKEN / 1e9) for _, c, t in v)
                  for k, v in timings.items()}
    row = {"store": store, "direction": direction,
           "bytes_per_s": ours_tps * BYTES_PER_TOKEN, "raw_bytes_per_s": raw_tps * BYTES_PER_TOKEN,
           "ratio": ours_tps / raw_tps, "cpu_s_per_gb": cpu_per_gb["ours"],
           "raw_cpu_s_per_gb": cpu_per_gb["raw"],
           "seconds": {k: [round(s, 3) for s, _, _ in v] for k, v in timings.items()},
           "cpu_seconds": {k: [round(c, 3) for _, c, _ in v] for k, v in timings.items()},
           **extra}
    if direction == "read":
        row.update(tokens_per_s=ours_tps, raw_tokens_per_s=raw_tps)
    if "raw_no_fsync" in timings:
        row["raw_no_fsync_bytes_per_s"] = BYTES_PER_TOKEN * statistics.median(
            t / s for s, _, t in timings["raw_no_fsync"])
    return row


def _serve_moto(port: int, ready, stop) -> None:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    ready.set()
    stop.wait()
    server.stop()


def moto_server():
    """A ThreadedMotoServer on 127.0.0.1 with bucket ``bench``, in a child process (so that the
    server does not share the measured process's GIL, as a real S3 endpoint would not):
    (stop callable, s3fs storage options)."""
    import multiprocessing

    import boto3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_serve_moto, args=(port, ready, stop), daemon=True)
    proc.start()
    if not ready.wait(60):
        raise RuntimeError("the moto server did not start within 60 s")
    url = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=url, aws_access_key_id="testing",
                 aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket="bench")

    def shutdown():
        stop.set()
        proc.join(30)

    return shutdown, {"endpoint_url": url, "key": "testing", "secret": "testing",
                      "client_kwargs": {"region_name": "us-east-1"}}


def run_store(store: str, root: str, so: dict, records: list[dict], args) -> list[dict]:
    """Read and write arms on one store, for each hidden-state codec."""
    import pyarrow as pa

    from pipeline import storage
    from pipeline.cache.format import SCHEMA

    tokens = sum(r["num_tokens"] for r in records)
    tables = [pa.Table.from_pylist(rows, schema=SCHEMA) for rows in shards_of(records)]
    rows = []
    for codec in args.codecs.split(","):
        options = parquet_options(codec)
        cache_dir = storage.join(root, f"cache-{codec}")
        manifest = write_cache(cache_dir, records, so, options)
        extra = {"codec": codec, "rows": len(records), "tokens": tokens,
                 "payload_bytes": tokens * BYTES_PER_TOKEN,
                 "stored_bytes": sum(s["bytes"] for s in manifest["splits"]["train"]["shards"])}
        reads = alternate({"ours": (None, lambda: read_ours(cache_dir, manifest, so)),
                           "raw": (None, lambda: read_raw(cache_dir, manifest, so))}, args.repeats)
        rows.append(summarize(store, "read", reads, extra))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "seconds"}), flush=True)
        ours_dir, raw_dir = storage.join(root, "w-ours"), storage.join(root, "w-raw")
        arms = {"ours": (lambda: remove(ours_dir, so),
                         lambda: write_ours(ours_dir, tables, so, options)),
                "raw": (lambda: remove(raw_dir, so),
                        lambda: (write_raw(raw_dir, tables, so, options), tokens)[1])}
        if store == "local":  # for reference: the page cache only, nothing on disk yet
            arms["raw_no_fsync"] = (lambda: remove(raw_dir, so), lambda: (
                write_raw(raw_dir, tables, so, options, sync=False), tokens)[1])
        writes = alternate(arms, args.repeats)
        for d in (ours_dir, raw_dir, cache_dir):
            remove(d, so)
        rows.append(summarize(store, "write", writes, extra))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "seconds"}), flush=True)
    return rows


def reading(rows: list[dict], meta: dict) -> str:
    """A short reading derived from the numbers (goal: ours >= 80 % of raw)."""
    below = [f"{r['store']} {r['direction']} ({r['codec']}) {r['ratio']:.2f}"
             for r in rows if r["ratio"] < 0.8]
    text = [("Every arm meets the goal (ours >= 0.80 of raw)." if not below else
             "Below the goal of 0.80: " + "; ".join(below) + ".")]
    by = {(r["store"], r["direction"], r["codec"]): r for r in rows}
    for store in ("local", "s3"):
        z, n = by.get((store, "read", "zstd")), by.get((store, "read", "none"))
        zw, nw = by.get((store, "write", "zstd")), by.get((store, "write", "none"))
        if z and n and zw and nw:
            mb = lambda r: f"{r['bytes_per_s'] / 1e6:,.0f}"  # noqa: E731
            text.append(
                f"{store}: zstd stores the hidden states in "
                f"{z['stored_bytes'] / n['stored_bytes']:.2f} of the uncompressed size; our "
                f"reader runs at {mb(z)} MB/s (zstd) vs {mb(n)} MB/s (none) using "
                f"{z['cpu_s_per_gb']:.2f} vs {n['cpu_s_per_gb']:.2f} CPU s/GB, our writer at "
                f"{mb(zw)} vs {mb(nw)} MB/s using {zw['cpu_s_per_gb']:.2f} vs "
                f"{nw['cpu_s_per_gb']:.2f} CPU s/GB.")
    nosync = [f"{r['codec']} {r['bytes_per_s'] / r['raw_no_fsync_bytes_per_s']:.2f}"
              for r in rows if "raw_no_fsync_bytes_per_s" in r]
    if nosync:
        text.append("Local writes against a raw write left in the page cache (no fsync, not "
                    "durable): " + ", ".join(nosync) + ".")
    if max(meta["load_before"], meta["load_after"]) > meta["cores"]:
        text.append(f"The machine was shared (load average {meta['load_before']} / "
                    f"{meta['load_after']} on {meta['cores']} cores): wall-clock numbers are "
                    "noisy; "
                    "CPU s/GB is the steadier comparison.")
    return " ".join(text)


def report(rows: list[dict], meta: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    mb = lambda x: f"{x / 1e6:,.0f}"
    lines = ["# Target-cache I/O throughput (measured)", "",
             f"{meta['date']}, git {meta['git']}, {meta['machine']}; {meta['rows']} rows of "
             f"H = {meta['hidden_size']} x {len(meta['layers'])} + 1 layers, "
             f"{meta['rows_per_shard']} rows per shard, {meta['rows_per_row_group']} per row "
             "group; "
             f"{meta['repeats']} alternating repeats per arm (median).", "",
             "| store | direction | hidden codec | ours MB/s | raw MB/s | ratio | ours tokens/s | "
             "raw tokens/s | ours CPU s/GB | raw CPU s/GB | payload MB | stored MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tps = (f"{r['tokens_per_s']:,.0f} | {r['raw_tokens_per_s']:,.0f}" if "tokens_per_s" in r
               else "- | -")
        lines.append(f"| {r['store']} | {r['direction']} | {r['codec']} | {mb(r['bytes_per_s'])} | "
                     f"{mb(r['raw_bytes_per_s'])} | {r['ratio']:.2f} | {tps} | "
                     f"{r['cpu_s_per_gb']:.2f} | {r['raw_cpu_s_per_gb']:.2f} | "
                     f"{mb(r['payload_bytes'])} | {mb(r['stored_bytes'])} |")
    lines += ["", f"Command: `{meta['command']}` ({meta['seconds']:.0f} s).", "", "## Reading",
              "", reading(rows, meta)]
    if meta.get("note"):
        lines += ["", meta["note"]]
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=96, help="cache rows (~2 MB each)")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--codecs", default="zstd,none", help="hidden-state column codecs to run")
    ap.add_argument("--stores", default="local,s3")
    ap.add_argument("--out", default=None, help=OUT_HELP)
    ap.add_argument("--note", default="", help="a paragraph appended to the reading")
    args = ap.parse_args()
    args.out = args.out or str(result_stem("cache_io"))
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

    start = time.perf_counter()
    records = synthetic_records(args.rows)
    meta = {"date": time.strftime("%Y-%m-%d"), "rows": args.rows, "repeats": args.repeats,
            "git": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                  capture_output=True, text=True).stdout.strip(),
            "machine": describe_machine(), "hardware": machine_fields(),
            "cores": os.cpu_count(),
            "load_before": round(os.getloadavg()[0], 2), "hidden_size": H, "layers": LAYERS,
            "rows_per_shard": ROWS_PER_SHARD, "rows_per_row_group": ROWS_PER_GROUP,
            "command": f"python benchmarks/cache_io.py --rows {args.rows} --repeats "
                       f"{args.repeats} --codecs {args.codecs} --stores {args.stores}",
            "note": args.note}
    rows = []
    stores = args.stores.split(",")
    if "local" in stores:
        with tempfile.TemporaryDirectory(prefix="cache_io_") as tmp:
            rows += run_store("local", tmp, {}, records, args)
    if "s3" in stores:
        stop, so = moto_server()
        try:
            rows += run_store("s3", "s3://bench", so, records, args)
        finally:
            stop()
    meta["load_after"] = round(os.getloadavg()[0], 2)
    meta["seconds"] = time.perf_counter() - start
    report(rows, meta, Path(args.out))


if __name__ == "__main__":
    main()
