"""Target-cache I/O throughput: the training reader against a raw pyarrow read of the same shards,
on a local directory and on a moto S3 server (127.0.0.1, started here).

Data: a synthetic cache written by the project's own writer (``pipeline.cache.write_shard``) at
SmolLM2-135M shapes: H = 576, 5 context layers, 256-384 tokens per row (6,917 B/token, ~2 MB per
row), bf16 features drawn from a Gaussian with log-normal per-channel scales (zstd shrinks them to
~0.80 of their size, as it does real SmolLM2 activations).

Arms, alternating (ours, raw, ours, raw, ...) for ``--repeats`` rounds; the ratio is of the medians:

- read, ours: ``CacheRowIndex`` + ``CacheRowReader.prefetch`` over one epoch's plan (one worker,
  micro-batches of 4, prefetch depth as in training), every row decoded to torch tensors;
- read, raw: ``pq.read_table`` of each shard through the same filesystem, nothing decoded.

Bytes/s count the cache payload (tokens x bytes_per_token of SPEC 1.4), the same for every arm.
Writes ``benchmarks/results/cache_io.{md,json}``.

    .venv/bin/python benchmarks/cache_io.py [--rows 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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


def write_cache(cache_dir: str, records: list[dict], so: dict) -> dict:
    """The project's writer, shard by shard; returns the manifest (also written)."""
    from pipeline import storage
    from pipeline.cache import build_manifest, shard_name, write_shard

    split_dir = storage.join(cache_dir, "train")
    shards = [write_shard(storage.join(split_dir, shard_name(k)),
                          records[i:i + ROWS_PER_SHARD], rows_per_row_group=ROWS_PER_GROUP,
                          storage_options=so, extra={"errors": []})
              for k, i in enumerate(range(0, len(records), ROWS_PER_SHARD))]
    manifest = build_manifest(target="synthetic", revision=None, layer_ids=LAYERS, hidden_size=H,
                              vocab_size=VOCAB, template_sha256="-", template_kwargs={},
                              max_length=4096, splits={"train": shards})
    storage.write_bytes_atomic(storage.join(cache_dir, "manifest.json"),
                               json.dumps(manifest).encode(), so)
    return manifest


def read_ours(cache_dir: str, manifest: dict, so: dict) -> int:
    """One epoch through the training reader; returns tokens read."""
    from pipeline.train import PREFETCH_MICRO_BATCHES
    from pipeline.train_data import CacheRowIndex, CacheRowReader, steps_per_epoch, worker_plan

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
    """Run the arms in turn ``repeats`` times: {arm: [(wall s, CPU s of this process, tokens)]}.
    CPU seconds (all threads) are less sensitive to other load on the machine than wall time."""
    out = {name: [] for name in arms}
    for _ in range(repeats):
        for name, fn in arms.items():
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
    return row


def _serve_moto(port: int, ready, stop) -> None:
    from moto.server import ThreadedMotoServer

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
                 aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket="bench")

    def shutdown():
        stop.set()
        proc.join(30)

    return shutdown, {"endpoint_url": url, "key": "testing", "secret": "testing",
                      "client_kwargs": {"region_name": "us-east-1"}}


def run_store(store: str, cache_dir: str, so: dict, records: list[dict], args) -> list[dict]:
    manifest = write_cache(cache_dir, records, so)
    tokens = manifest["splits"]["train"]["tokens"]
    payload = {"rows": len(records), "tokens": tokens, "payload_bytes": tokens * BYTES_PER_TOKEN,
               "stored_bytes": sum(s["bytes"] for s in manifest["splits"]["train"]["shards"])}
    timings = alternate({"ours": lambda: read_ours(cache_dir, manifest, so),
                         "raw": lambda: read_raw(cache_dir, manifest, so)}, args.repeats)
    return [summarize(store, "read", timings, payload)]


def report(rows: list[dict], meta: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.with_suffix(".json")).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    mb = lambda x: f"{x / 1e6:,.0f}"
    lines = ["# Target-cache I/O throughput (measured)", "",
             f"{meta['date']}, git {meta['git']}, {meta['machine']}; {meta['rows']} rows, "
             f"{meta['repeats']} alternating repeats per arm (median), load average "
             f"{meta['load_before']} before / {meta['load_after']} after.", "",
             "| store | direction | ours MB/s | raw MB/s | ratio | ours tokens/s | raw tokens/s | "
             "payload MB | stored MB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tps = (f"{r['tokens_per_s']:,.0f} | {r['raw_tokens_per_s']:,.0f}" if "tokens_per_s" in r
               else "- | -")
        lines.append(f"| {r['store']} | {r['direction']} | {mb(r['bytes_per_s'])} | "
                     f"{mb(r['raw_bytes_per_s'])} | {r['ratio']:.2f} | {tps} | "
                     f"{mb(r['payload_bytes'])} | {mb(r['stored_bytes'])} |")
    lines += ["", f"Command: `{meta['command']}`.", "", "## Reading", "", meta.get("reading", "")]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=128, help="cache rows (~2 MB each)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stores", default="local,s3")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cache_io"))
    args = ap.parse_args()
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

    records = synthetic_records(args.rows)
    meta = {"date": time.strftime("%Y-%m-%d"), "rows": args.rows, "repeats": args.repeats,
            "git": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                  capture_output=True, text=True).stdout.strip(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
            "load_before": round(os.getloadavg()[0], 2), "hidden_size": H, "layers": LAYERS,
            "rows_per_shard": ROWS_PER_SHARD, "rows_per_row_group": ROWS_PER_GROUP,
            "command": "python benchmarks/cache_io.py " + " ".join(sys.argv[1:])}
    rows = []
    stores = args.stores.split(",")
    if "local" in stores:
        with tempfile.TemporaryDirectory(prefix="cache_io_") as tmp:
            rows += run_store("local", str(Path(tmp, "cache")), {}, records, args)
    if "s3" in stores:
        stop, so = moto_server()
        try:
            rows += run_store("s3", "s3://bench/cache", so, records, args)
        finally:
            stop()
    meta["load_after"] = round(os.getloadavg()[0], 2)
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k != "seconds"}))
    report(rows, meta, Path(args.out))


if __name__ == "__main__":
    main()
