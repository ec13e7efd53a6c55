"""Fault matrix of the data and training stages: kill, corrupt, throttle, fill the disk.

Each fault runs against a small quickstart pipeline (the real SmolLM2 target, 12 GSM8K prompts,
greedy answers generated one prompt per batch so that every answer is a function of its prompt
alone, 2-row cache shards, 8 optimizer steps on 2 workers with a checkpoint every 2) and is compared
with a fault-free run of the same inputs by sample ids and content hashes (generated
conversations, cache rows) and by the final drafter weights. Per fault the table says whether the
stage finished on its own, after a re-run, or not at all, and what was lost, duplicated or changed.

    .venv/bin/python benchmarks/fault_matrix.py [--faults NAME,...] [--out PREFIX]

Writes ``<out>.md`` and ``<out>.json`` (default ``benchmarks/results/fault_matrix/<date>_<machine class>``). The full-disk
row mounts a small tmpfs and needs root; without it the row says so. Takes ~20 min on 2 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.machine import describe as describe_machine, machine as machine_fields  # noqa: E402,I001
from benchmarks.machine import OUT_HELP, latest_stem, result_stem  # noqa: E402
from pipeline.run_layout import GENERATE, PROMPTS, TRAIN, RunLayout  # noqa: E402

from tests.faulty_s3 import FaultyS3Proxy  # noqa: E402 - after the path insert

CONFIG = ROOT / "infra" / "configs" / "quickstart.yaml"
SMALL = [  # the quickstart, small: see the module docstring
    "prompts.sources=[{path: infra/datasets/train/prompts_gsm8k.jsonl.gz, max_rows: 12}]",
    "prompts.heldout_fraction=0.1",
    "generate.sampling={temperature: 0.0, top_p: 1.0, top_k: 0, max_new_tokens: 24}",
    "generate.batch_size=1",
    "cache.rows_per_shard=2", "cache.rows_per_row_group=1",
    "train.max_steps=8", "train.checkpoint_every=2", "train.resume_from=latest",
    "train.init_from=null",  # the quickstart fine-tunes the shipped drafter; resuming excludes it
    "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_every=null",
    "wandb.mode=disabled",
]
DATA_STAGES = (PROMPTS, GENERATE)


# ------------------------------------------------------------------------------ running the pipeline
class Run:
    """One pipeline run directory and the commands run on it."""

    def __init__(self, root: Path, name: str, extra: list[str] | None = None):
        self.name, self.dir = name, root / name
        self.extra = list(extra or [])
        self.log = root / f"{name}.log"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.layout = RunLayout(self.dir)

    @property
    def cache_dir(self) -> str:
        for item in self.extra:
            if item.startswith("cache.output="):
                return item.split("=", 1)[1]
        return str(self.layout.default_cache_dir)

    def command(self, stages: str, *flags: str) -> list[str]:
        sets = [f"run_dir={self.dir}", *SMALL, *self.extra]
        return [sys.executable, str(ROOT / "pipeline" / "run.py"), "--config", str(CONFIG),
                "--stages", stages, *flags, *(x for s in sets for x in ("--set", s))]

    def start(self, stages: str, *flags: str) -> subprocess.Popen:
        fh = open(self.log, "a")
        fh.write(f"\n$ {' '.join(self.command(stages, *flags))}\n")
        fh.flush()
        # a session of its own: a killed driver's local Ray processes can be swept up with it
        return subprocess.Popen(self.command(stages, *flags), stdout=fh, stderr=subprocess.STDOUT,
                                cwd=ROOT, start_new_session=True)

    def run(self, stages: str, *flags: str, timeout: float = 900) -> int:
        proc = self.start(stages, *flags)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_session(proc)
            return -9

    def tail(self, lines: int = 200) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def copy_stages_from(self, other: "Run", stages: tuple[str, ...],
                         markers: bool = True) -> None:
        """Start from another run's finished stages; without ``markers`` the stages run again
        and resume from the copied outputs (needed when their config fingerprint differs)."""
        for stage in stages:
            shutil.copytree(other.layout.stage_dir(stage), self.layout.stage_dir(stage))
            if not markers:
                self.layout.marker(stage).unlink(missing_ok=True)


def session_pids(session: int) -> list[int]:
    """Processes of a session (the driver's: Ray regroups its processes but keeps the session)."""
    import psutil

    pids = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == session:
                pids.append(pid)
        except (ProcessLookupError, PermissionError):
            continue
    return pids


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the driver's whole session (the driver and the local Ray it started)."""
    for pid in session_pids(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def kill_driver(proc: subprocess.Popen) -> None:
    """kill -9 of the driver alone; after a moment its orphaned local Ray goes too (as when the
    head node dies), so that the re-run starts a fresh one."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(2)
    kill_session(proc)
    time.sleep(1)


def process_matching(needle: str, session: int) -> int | None:
    """The first process of ``session`` whose command line contains ``needle``."""
    import psutil

    for pid in session_pids(session):
        try:
            cmd = " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            continue
        if needle in cmd:
            return pid
    return None


def kill_process_matching(needle: str, session: int) -> int | None:
    """SIGKILL the first process of ``session`` whose command line contains ``needle``."""
    pid = process_matching(needle, session)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
    return pid


def wait_until(predicate, proc: subprocess.Popen, timeout: float = 600, poll: float = 0.2) -> bool:
    """Wait for ``predicate()``; False if the process ended or the time ran out first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(poll)
    return False


def lines_in(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


def sidecars(cache_dir: str) -> int:
    return len(list(Path(cache_dir, "train").glob("shard-*.json"))) if "://" not in cache_dir else 0


def checkpoint_steps(run: Run, complete: bool = False) -> list[int]:
    """Steps of the run's checkpoints (``complete``: only those whose completion marker is
    written, ``pipeline/checkpoints.py``)."""
    from pipeline.checkpoints import MARKER

    return sorted(json.loads(p.read_text())["step"]
                  for p in (run.layout.ray_train_dir).glob("*/checkpoint_*/train_state.json")
                  if not complete or (p.parent / MARKER).exists())


# ------------------------------------------------------------------------------ comparing outputs
def generated(run: Run) -> dict:
    """{id: [sha256 of its conversation, ...]} over both splits (a list: duplicates show)."""
    out: dict[str, list[str]] = {}
    for split in ("train", "heldout"):
        path = run.layout.generated(split)
        for line in (path.read_text().splitlines() if path.exists() else []):
            row = json.loads(line)
            digest = hashlib.sha256(json.dumps(row["messages"], sort_keys=True).encode()).hexdigest()
            out.setdefault(row["id"], []).append(digest)
    return out


def cache_rows(run: Run, storage_options: dict | None = None) -> dict:
    """{sample_id: [sha256 of its row bytes, ...]} over the shards the manifest lists."""
    import pyarrow.parquet as pq

    from pipeline import storage

    so = storage_options or {}
    manifest = json.loads(storage.read_bytes(storage.join(run.cache_dir, "manifest.json"), so))
    out: dict[str, list[str]] = {}
    for split, info in manifest["splits"].items():
        for shard in info["shards"]:
            data = storage.read_bytes(storage.join(run.cache_dir, split, shard["file"]), so)
            assert hashlib.sha256(data).hexdigest() == shard["sha256"], shard["file"]
            import io

            for row in pq.read_table(io.BytesIO(data)).to_pylist():
                h = hashlib.sha256()
                for col in ("input_ids", "loss_mask", "context_hidden", "last_hidden"):
                    h.update(row[col])
                out.setdefault(row["sample_id"], []).append(h.hexdigest())
    return out


def weights(run: Run):
    from safetensors.torch import load_file

    return load_file(str(run.layout.drafter(TRAIN) / "model.safetensors"))


def compare(reference: dict, got: dict) -> dict:
    """Lost, duplicated and changed ids of ``got`` against the fault-free ``reference``."""
    return {"lost": sorted(set(reference) - set(got)),
            "duplicated": sorted(k for k, v in got.items() if len(v) > 1),
            "changed": sorted(k for k in set(reference) & set(got) if got[k][0] != reference[k][0]),
            "extra": sorted(set(got) - set(reference))}


def weight_diff(reference, got) -> float:
    return max(float((reference[k].float() - got[k].float()).abs().max()) for k in reference)


# ------------------------------------------------------------------------------ S3 with faults
def moto_server():
    """(server, port) of a moto S3 server on 127.0.0.1 with bucket ``faults``."""
    import socket

    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="testing",
                 aws_secret_access_key="testing", region_name="us-east-1").create_bucket(
        Bucket="faults")
    return server, port


def s3_options(port: int) -> dict:
    """s3fs options of the local endpoint on ``port`` (moto's or the proxy's)."""
    return {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"}}


def s3_sets(port: int, prefix: str) -> list[str]:
    """Config overrides: the cache under s3://faults/<prefix>/ through the endpoint on ``port``."""
    return [f"cache.output=s3://faults/{prefix}/cache",
            f"storage_options={json.dumps(s3_options(port))}"]


# ------------------------------------------------------------------------------ the faults
def outcome(first_rc: int, rerun_rc: int | None) -> str:
    if first_rc == 0:
        return "finished on its own"
    if rerun_rc == 0:
        return "finished after a re-run"
    return "did not finish"


def fault_generate_actor_kill(root: Path, ref: dict) -> dict:
    run = Run(root, "generate_actor_kill")
    proc = run.start("prompts,generate")
    path = run.layout.generated("train")
    hit = wait_until(lambda: lines_in(path) >= 3, proc)
    pid = kill_process_matching("GenerateUDF", proc.pid) if hit else None
    rc = proc.wait(timeout=900)
    rerun = None if rc == 0 else run.run("prompts,generate")
    return {"fault": "kill -9 of the generate actor mid-batch", "injected": pid is not None,
            "outcome": outcome(rc, rerun), "stage": "generate",
            **compare(ref["generated"], generated(run))}


def fault_generate_driver_kill(root: Path, ref: dict) -> dict:
    run = Run(root, "generate_driver_kill")
    proc = run.start("prompts,generate")
    path = run.layout.generated("train")
    hit = wait_until(lambda: lines_in(path) >= 3, proc)
    kill_driver(proc) if hit else proc.wait()
    rerun = run.run("prompts,generate")
    return {"fault": "kill -9 of the driver during generate, then the same command",
            "injected": hit, "outcome": outcome(-9 if hit else proc.returncode, rerun),
            "stage": "generate", **compare(ref["generated"], generated(run))}


def kill_when(run: "Run", stages: str, ready, needle: str | None, poll: float = 0.2
              ) -> tuple[bool, int, int | None]:
    """Start ``stages``, wait until ``ready(proc)``, then kill -9 the process whose command line
    holds ``needle`` (None: the driver), let the run end, and re-run the same stages if it
    failed. Returns (the fault was injected, the first exit code, the re-run's or None)."""
    proc = run.start(stages)
    hit = wait_until(lambda: ready(proc), proc, poll=poll)
    pid = None
    if hit and needle:
        pid = kill_process_matching(needle, proc.pid)
    elif hit:
        kill_driver(proc)
    rc = proc.wait(timeout=900)
    rerun = None if rc == 0 else run.run(stages)
    return hit and (needle is None or pid is not None), rc, rerun


def _cache_fault(root: Path, ref_run: Run, ref: dict, name: str, what: str, needle: str | None):
    run = Run(root, name)
    run.copy_stages_from(ref_run, DATA_STAGES)
    injected, rc, rerun = kill_when(run, "prompts,generate,cache",
                                    lambda proc: sidecars(run.cache_dir) >= 2, needle)
    return {"fault": what, "injected": injected, "outcome": outcome(rc, rerun), "stage": "cache",
            **compare(ref["cache"], cache_rows(run))}


def fault_cache_actor_kill(root, ref_run, ref):
    return _cache_fault(root, ref_run, ref, "cache_actor_kill",
                        "kill -9 of the cache actor mid-shard", "CacheWriterUDF")


def fault_cache_driver_kill(root, ref_run, ref):
    return _cache_fault(root, ref_run, ref, "cache_driver_kill",
                        "kill -9 of the driver during cache, then the same command", None)


def _train_fault(root: Path, ref_run: Run, ref: dict, name: str, what: str, worker: bool):
    run = Run(root, name, ["train.max_failures=1"] if worker else [])
    run.copy_stages_from(ref_run, (*DATA_STAGES, "cache"))
    injected, rc, rerun = kill_when(run, "prompts,generate,cache,train",
                                    lambda proc: 2 in checkpoint_steps(run),
                                    "RayTrainWorker" if worker else None, poll=0.05)
    row = {"fault": what, "injected": injected, "outcome": outcome(rc, rerun), "stage": "train", "lost": [], "duplicated": [],
           "changed": [], "extra": []}
    if (run.layout.drafter(TRAIN) / "model.safetensors").exists():
        row["max_weight_diff"] = weight_diff(ref["weights"], weights(run))
        log = [json.loads(l) for l in
               (run.layout.training_log).read_text().splitlines()]
        row["logged_steps"] = [h["step"] for h in log]
    return row


def fault_train_worker_kill(root, ref_run, ref):
    return _train_fault(root, ref_run, ref, "train_worker_kill",
                        "kill -9 of one training worker mid-run (max_failures 1)", True)


def fault_train_driver_kill(root, ref_run, ref):
    return _train_fault(root, ref_run, ref, "train_driver_kill",
                        "kill -9 of the whole training job, then the same command", False)


# online: more steps than the small pipeline's 8 and a tiny object-store budget, so the feature
# actor is still at work (held back by back-pressure) when the fault comes, and no local shuffle
# (with 11 samples an epoch, 64 buffered rows would blur six epochs)
ONLINE = ["train.max_steps=40", "train.stream_object_store_gib=0.001",
          "train.stream_shuffle_rows=0"]
_online_reference: dict = {}


def online_reference(root: Path, ref_run: Run) -> dict:
    """The consumed-sample record of a fault-free online run with the faults' settings (once per
    invocation): the epochs a run of 40 steps leaves open at its end, against which a faulty
    run's record is compared."""
    if not _online_reference:
        run = Run(root, "online_reference", ["train.data_mode=online", *ONLINE])
        run.copy_stages_from(ref_run, DATA_STAGES)
        if run.run("prompts,generate,cache,train") != 0:
            raise RuntimeError(f"the fault-free online run failed: {run.tail(40)}")
        _online_reference.update(stream_record(run) or {})
    return _online_reference


def _streamed_fault(root: Path, ref_run: Run, ref: dict, name: str, what: str, mode: str,
                    kill: str | None) -> dict:
    """A fault during ``train.data_mode`` online or hybrid: kill -9 of a process whose command
    line holds ``kill`` (a feature actor, a training worker; ``max_failures`` 1) or, for None, of
    the driver (then the same command again). Online stores no cache: its accounting is the
    checkpoints' consumed-sample record against a fault-free online run's (lost = samples that
    run trained on per epoch and this one did not; duplicated = samples trained on twice within
    an epoch); hybrid's cache is compared with the fault-free cache stage's, row by row."""
    run = Run(root, name, [f"train.data_mode={mode}", "train.max_failures=1",
                           *(ONLINE if mode == "online" else [])])
    run.copy_stages_from(ref_run, DATA_STAGES)
    if mode == "hybrid" and kill is None:  # mid-way through the streamed, cache-writing epoch
        ready = lambda proc: sidecars(run.cache_dir) >= 2  # noqa: E731
    elif kill == "FeatureStreamUDF":  # as soon as the actor runs: it streams the whole schedule
        ready = lambda proc: process_matching(kill, proc.pid) is not None  # noqa: E731
    else:  # a complete checkpoint to continue from (marker written), and steps still to go
        ready = lambda proc: 2 in checkpoint_steps(run, complete=True)  # noqa: E731
    expected = online_reference(root, ref_run) if mode == "online" else None
    injected, rc, rerun = kill_when(run, "prompts,generate,cache,train", ready, kill, poll=0.05)
    row = {"fault": what, "injected": injected, "outcome": outcome(rc, rerun),
           "stage": f"train ({mode})", "lost": [], "duplicated": [], "changed": [], "extra": []}
    if mode == "hybrid" and (run.layout.default_cache_dir / "manifest.json").exists():
        row.update(compare(ref["cache"], cache_rows(run)))
    record = stream_record(run)
    if record:
        row["stream_epochs"] = {e: f"{d}/{record['rows']} distinct, {record['seen'][e]} trained on"
                                for e, d in record["distinct"].items()}
        row["stream_repeated"] = sum(record["seen"][e] - d for e, d in record["distinct"].items())
    if mode == "online" and record:
        row["lost"] = sum(max(0, d - record["distinct"].get(e, 0))
                          for e, d in expected["distinct"].items())
        row["duplicated"] = row.pop("stream_repeated")
    if (run.layout.training_log).exists():
        log = [json.loads(l) for l in
               (run.layout.training_log).read_text().splitlines()]
        row["logged_steps"] = [h["step"] for h in log]
        row["resumes"] = log[-1].get("resumes", 0)
    return row


def stream_record(run: Run) -> dict | None:
    """The newest checkpoint's consumed-sample record (``pipeline/stream_state.py``):
    ``rows`` per epoch, per epoch the ``seen`` (trained on) and ``distinct`` counts; None
    without one. For hybrid only its first, streamed epoch has a record."""
    from pipeline.stream_state import STATE_FILE, StreamState

    from pipeline.checkpoints import MARKER

    files = sorted(p for p in (run.layout.ray_train_dir).glob(f"*/checkpoint_*/{STATE_FILE}")
                   if (p.parent / MARKER).exists())  # complete checkpoints only
    if not files:
        return None
    state = StreamState.from_json(files[-1].read_text())  # checkpoint names sort by time
    return {"rows": state.rows_per_epoch, "seen": dict(sorted(state.seen.items())),
            "distinct": dict(sorted(state.distinct.items()))}


def fault_online_feature_actor_kill(root, ref_run, ref):
    return _streamed_fault(root, ref_run, ref, "online_feature_actor_kill",
                           "kill -9 of the online feature actor mid-run", "online",
                           "FeatureStreamUDF")


def fault_online_train_worker_kill(root, ref_run, ref):
    return _streamed_fault(root, ref_run, ref, "online_train_worker_kill",
                           "kill -9 of one training worker mid-run, online (max_failures 1)",
                           "online", "RayTrainWorker")


def fault_hybrid_driver_kill(root, ref_run, ref):
    return _streamed_fault(root, ref_run, ref, "hybrid_driver_kill",
                           "kill -9 of the driver while hybrid's first epoch writes the cache, "
                           "then the same command", "hybrid", None)


def fault_s3_transient(root, ref_run, ref):
    server, port = moto_server()
    proxy = FaultyS3Proxy(port, lambda method, path, nth: "shard-" in path and nth % 2 == 0)
    try:
        run = Run(root, "s3_transient", s3_sets(proxy.port, "transient"))
        run.copy_stages_from(ref_run, DATA_STAGES, markers=False)
        rc = run.run("prompts,generate,cache")
        got = cache_rows(run, s3_options(port)) if rc == 0 else {}
        return {"fault": "S3 503 SlowDown on every 2nd shard upload", "injected": proxy.injected > 0,
                "outcome": outcome(rc, None), "stage": "cache", "faults_injected": proxy.injected,
                **compare(ref["cache"], got)}
    finally:
        proxy.close()
        server.stop()


def fault_s3_permanent(root, ref_run, ref):
    import s3fs

    server, port = moto_server()
    state = {"broken": True}
    proxy = FaultyS3Proxy(port, lambda method, path, nth: state["broken"]
                          and "shard-00001.parquet" in path)
    try:
        run = Run(root, "s3_permanent", s3_sets(proxy.port, "permanent"))
        run.copy_stages_from(ref_run, DATA_STAGES, markers=False)
        rc = run.run("prompts,generate,cache")
        fs = s3fs.S3FileSystem(**s3_options(port))
        key = "faults/permanent/cache/train/shard-00001.parquet"
        leftover = fs.exists(key) or fs.exists(key[:-len(".parquet")] + ".json")
        message = next((l for l in reversed(run.tail().splitlines())
                        if "SlowDown" in l or "ERROR" in l), "")
        state["broken"] = False
        rerun = run.run("prompts,generate,cache")
        got = cache_rows(run, s3_options(port)) if rerun == 0 else {}
        return {"fault": "S3 503 on every upload of one shard (the write finally fails), then "
                         "the fault clears and the same command runs",
                "injected": proxy.injected > 0, "outcome": outcome(rc, rerun), "stage": "cache",
                "object_at_final_key_after_failure": leftover, "error": message[-300:],
                **compare(ref["cache"], got)}
    finally:
        proxy.close()
        server.stop()


def fault_disk_full(root, ref_run, ref):
    mount = root / "small_disk"
    mount.mkdir(exist_ok=True)
    shard_bytes = max(s["bytes"] for s in ref["manifest"]["splits"]["train"]["shards"])
    size_kb = max(64, int(shard_bytes * 2.5 / 1024))  # room for about two shards
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs",
                              str(mount)], capture_output=True, text=True)
    if mounted.returncode != 0:
        return {"fault": "disk full during cache writing", "injected": False,
                "outcome": f"not run: cannot mount a tmpfs ({mounted.stderr.strip()[:120]})",
                "stage": "cache", "lost": [], "duplicated": [], "changed": [], "extra": []}
    try:
        run = Run(root, "disk_full", [f"cache.output={mount}/cache"])
        run.copy_stages_from(ref_run, DATA_STAGES)
        rc = run.run("prompts,generate,cache")
        temporaries = [p.name for p in mount.rglob(".*tmp*")]
        unlisted_partial = [p.name for p in mount.rglob("shard-*.parquet")
                            if not p.with_suffix(".json").exists()]
        message = next((l for l in reversed(run.tail().splitlines())
                        if "No space left" in l or "ERROR" in l), "")
        subprocess.run(["mount", "-o", "remount,size=512m", str(mount)], check=True)
        rerun = run.run("prompts,generate,cache")
        got = cache_rows(run) if rerun == 0 else {}
        return {"fault": f"disk full during cache writing ({size_kb} KiB tmpfs), then space freed",
                "injected": rc != 0, "outcome": outcome(rc, rerun), "stage": "cache",
                "temporaries_left": temporaries, "shards_without_sidecar": unlisted_partial,
                "error": message[-300:], **compare(ref["cache"], got)}
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def fault_shard_damaged(root, ref_run, ref):
    run = Run(root, "shard_damaged")
    run.copy_stages_from(ref_run, (*DATA_STAGES, "cache"))
    shards = sorted(Path(run.cache_dir, "train").glob("shard-*.parquet"))
    victim = shards[len(shards) // 2]
    data = bytearray(victim.read_bytes())
    data[len(data) // 3: len(data) // 3 + 8] = b"\xff" * 8
    victim.write_bytes(bytes(data))
    others = {p: p.stat().st_mtime_ns for p in shards if p != victim}
    rc = run.run("prompts,generate,cache,train")
    named = victim.name in run.tail()
    rerun = run.run("prompts,generate,cache,train", "--repair-cache")
    rewritten = sorted(p.name for p, t in others.items() if p.stat().st_mtime_ns != t)
    return {"fault": "bytes flipped in one cache shard after writing; then --repair-cache",
            "injected": True, "outcome": outcome(rc, rerun), "stage": "train",
            "shard_named_at_training_start": named, "other_shards_rewritten": rewritten,
            **compare(ref["cache"], cache_rows(run))}


def fault_nan_row(root, ref_run, ref):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.cache.format import SCHEMA

    run = Run(root, "nan_row")
    run.copy_stages_from(ref_run, (*DATA_STAGES, "cache"))
    manifest_path = Path(run.cache_dir, "manifest.json")
    manifest = json.loads(manifest_path.read_text())
    shard = manifest["splits"]["train"]["shards"][0]
    path = Path(run.cache_dir, "train", shard["file"])
    rows = pq.read_table(path).to_pylist()
    rows[0]["context_hidden"] = b"\xc0\x7f" * (len(rows[0]["context_hidden"]) // 2)  # bf16 NaN
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), path, row_group_size=1)
    shard["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()  # only the NaN is wrong
    manifest_path.write_text(json.dumps(manifest, indent=1))
    rc = run.run("prompts,generate,cache,train")
    row = {"fault": "NaN feature row in the cache (hash updated: only the loss sees it)",
           "injected": True, "outcome": outcome(rc, None), "stage": "train", "lost": [],
           "duplicated": [], "changed": [], "extra": []}
    log_path = run.layout.training_log
    if log_path.exists():
        log = [json.loads(l) for l in log_path.read_text().splitlines()]
        row["skipped_steps"] = log[-1].get("skipped_steps")
        row["max_weight_diff"] = weight_diff(ref["weights"], weights(run))
    return row


# ------------------------------------------------------------------------------ bad user inputs
def tree_digest(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under ``root``, except ``config.yaml`` (each
    invocation records its own config there by design) and logs."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "config.yaml" and p.suffix != ".log"}


def file_changes(before: dict[str, str], after: dict[str, str]) -> dict:
    """Matrix-row fields from two :func:`tree_digest` results: files gone (lost), with other
    bytes (changed) or new (extra)."""
    return {"lost": sorted(set(before) - set(after)),
            "changed": sorted(k for k in set(before) & set(after) if before[k] != after[k]),
            "duplicated": [], "extra": sorted(set(after) - set(before))}


def sources_with(path: Path) -> str:
    """The small pipeline's ``prompts.sources`` with the file ``path`` added."""
    src = next(s for s in SMALL if s.startswith("prompts.sources="))
    return src.split("=", 1)[1].rstrip("]") + f", {{path: {path}}}]"


def _bad_input(root: Path, ref_run: Run, name: str, what: str, stage: str, sets: list[str],
               needles: list[str], expect_rc: int = 1, flags: tuple[str, ...] = ()) -> dict:
    """Run every stage on a copy of the finished reference run with one bad input: the command
    must fail with a message holding ``needles`` (the file, line or field) and leave every file
    already written unchanged (lost = files gone, changed = files with other bytes)."""
    run = Run(root, name, sets)
    shutil.rmtree(run.dir)
    shutil.copytree(ref_run.dir, run.dir)
    before = tree_digest(run.dir)
    rc = run.run("prompts,generate,cache,train,calibrate,eval", *flags)
    tail = run.tail(40)
    after = tree_digest(run.dir)
    named = [n for n in needles if n not in tail]
    ok = rc == expect_rc and not named
    return {"fault": what, "stage": stage, "injected": True,
            "outcome": "refused with a message naming it" if ok else
            f"rc {rc}; missing from the message: {named}",
            "message": next((l for l in reversed(tail.splitlines()) if any(
                n in l for n in needles)), tail.splitlines()[-1] if tail else "")[-300:],
            **file_changes(before, after)}


def fault_bad_prompt_rows(root, ref_run, ref):
    """A prompt file with bad rows: each is reported by file and line, the rest go on."""
    bad = root / "bad_prompts.jsonl"
    bad.write_text("\n".join([
        '{"id": "broken", "messages": [',
        json.dumps({"id": "nomsg"}),
        json.dumps({"id": "asst", "messages": [{"role": "assistant", "content": "hi"}]}),
        json.dumps({"id": "blank", "messages": [{"role": "user", "content": " "}]})]) + "\n")
    sources = sources_with(bad)
    run = Run(root, "bad_prompt_rows", [f"prompts.sources={sources}"])
    rc = run.run(PROMPTS)
    errors = [json.loads(l) for l in run.layout.errors(PROMPTS).read_text()
              .splitlines()] if rc == 0 else []
    named = sorted(e["line"] for e in errors if e["file"] == str(bad))
    same = all((run.layout.stage_dir(PROMPTS) / f).read_bytes() == (ref_run.layout.stage_dir(PROMPTS) / f).read_bytes()
               for f in ("train.jsonl", "heldout.jsonl"))
    return {"fault": "prompt JSONL with 4 bad rows (malformed JSON, no messages, assistant "
                     "first, blank turn) next to the good file", "stage": "prompts",
            "injected": True, "outcome": outcome(rc, None), "bad_rows_named_by_line": named,
            "prompts_equal_to_reference": same, "lost": [] if same else ["prompts differ"],
            "duplicated": [], "changed": [], "extra": []}


def fault_bad_prompt_parquet(root, ref_run, ref):
    """A new run whose prompt sources include a .parquet file that is not Parquet."""
    bad = root / "not_parquet.parquet"
    bad.write_text('{"id": "a"}\n')
    sources = sources_with(bad)
    run = Run(root, "bad_prompt_parquet", [f"prompts.sources={sources}"])
    rc = run.run("prompts,generate")
    needles = [str(bad), "not a readable Parquet"]
    ok = rc == 1 and all(n in run.tail(40) for n in needles)
    return {"fault": "a .parquet prompt file that is not Parquet (new run)", "stage": "prompts",
            "injected": True, "outcome": "refused with a message naming it" if ok else f"rc {rc}",
            "stages_marked_done": sorted(p.parent.name for p in run.dir.glob("*/_SUCCESS.json")),
            "lost": [], "duplicated": [], "changed": [], "extra": []}


def fault_bad_config(root, ref_run, ref):
    return _bad_input(root, ref_run, "bad_config", "config with a wrong type and an unknown key",
                      "config", ["train.lr=fast", "cache.colour=red"],
                      ["train.lr", "cache.colour: unknown key"], expect_rc=2)


def fault_bad_benchmark_file(root, ref_run, ref):
    data = root / "eval_data"
    shutil.copytree(ROOT / "infra" / "datasets" / "eval", data)
    import gzip

    path = data / "gsm8k.jsonl.gz"
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    lines[2] = '{"turns": '  # line 3 cut short
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    return _bad_input(root, ref_run, "bad_benchmark_file",
                      "a benchmark file with a malformed line", "eval",
                      [f"eval.data_dir={data}"], [f"{path}:3"])


def fault_bad_target_dir(root, ref_run, ref):
    target = root / "empty_target"
    target.mkdir(exist_ok=True)
    return _bad_input(root, ref_run, "bad_target_dir", "a target directory with no model",
                      "all", [f"target.name_or_path={target}"],
                      ["unknown target model", str(target)])


def fault_bad_drafter_dir(root, ref_run, ref):
    drafter = root / "damaged_drafter"
    shutil.copytree(ref_run.layout.drafter(TRAIN), drafter)
    weights = drafter / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    row = _bad_input(root, ref_run, "bad_drafter_dir",
                     "--force train with train.init_from a drafter directory with truncated "
                     "weights", "train",
                     ["train.resume_from=null", f"train.init_from={drafter}"],
                     [str(weights), "damaged"], flags=("--force", "train"))
    return row


def fault_cache_other_target(root, ref_run, ref):
    """cache.output pointing at the reference run's cache from a config with other layers."""
    cache = Path(ref_run.cache_dir)
    before = tree_digest(cache)
    run = Run(root, "cache_other_target", [f"cache.output={cache}", "target.layer_ids=[2, 9, 16]"])
    run.copy_stages_from(ref_run, DATA_STAGES, markers=False)
    rc = run.run("prompts,generate,cache,train")
    after = tree_digest(cache)
    needles = [str(cache / "manifest.json"), "layer_ids"]
    named = all(n in run.tail(40) for n in needles)
    return {"fault": "cache.output pointing at a cache of other target layers", "stage": "cache",
            "injected": True, "outcome": "refused with a message naming it"
            if rc == 1 and named else f"rc {rc}, named {named}",
            **file_changes(before, after)}


FAULTS = {
    "generate_actor_kill": fault_generate_actor_kill,
    "generate_driver_kill": fault_generate_driver_kill,
    "cache_actor_kill": fault_cache_actor_kill,
    "cache_driver_kill": fault_cache_driver_kill,
    "train_worker_kill": fault_train_worker_kill,
    "train_driver_kill": fault_train_driver_kill,
    "online_feature_actor_kill": fault_online_feature_actor_kill,
    "online_train_worker_kill": fault_online_train_worker_kill,
    "hybrid_driver_kill": fault_hybrid_driver_kill,
    "s3_transient": fault_s3_transient,
    "s3_permanent": fault_s3_permanent,
    "disk_full": fault_disk_full,
    "shard_damaged": fault_shard_damaged,
    "nan_row": fault_nan_row,
    "bad_prompt_rows": fault_bad_prompt_rows,
    "bad_prompt_parquet": fault_bad_prompt_parquet,
    "bad_config": fault_bad_config,
    "bad_benchmark_file": fault_bad_benchmark_file,
    "bad_target_dir": fault_bad_target_dir,
    "bad_drafter_dir": fault_bad_drafter_dir,
    "cache_other_target": fault_cache_other_target,
}
NEEDS_REF_RUN = {name for name in FAULTS if not name.startswith("generate_")}


# ------------------------------------------------------------------------------ report
def count(ids_or_count) -> int:
    """A row's lost / duplicated / changed: sample ids, or a count (streamed samples)."""
    return ids_or_count if isinstance(ids_or_count, int) else len(ids_or_count)


def write_report(rows: list[dict], meta: dict, out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["# Fault matrix (measured)", "",
             f"{meta['pipeline']} Machine: {meta['machine']}. {meta['date']}, "
             f"{meta['seconds']:.0f} s. Command: `{meta['command']}`.", "",
             "lost / duplicated / changed = sample ids missing, present twice, or with other "
             "content (sha256 of the conversation or the cache row) than in the fault-free run; "
             "weights = max |difference| of the final drafter's parameters against the "
             "fault-free run (same seed).", "",
             "| fault | stage | outcome | lost | duplicated | changed | weights | notes |",
             "|---|---|---|---|---|---|---|---|"]
    skip = {"fault", "stage", "outcome", "lost", "duplicated", "changed", "extra",
            "max_weight_diff", "injected"}
    for r in rows:
        notes = "; ".join(f"{k}: {v}" for k, v in r.items() if k not in skip and v not in ([], None))
        if not r.get("injected", True):
            notes = "FAULT NOT INJECTED; " + notes
        w = r.get("max_weight_diff")
        lines.append(f"| {r['fault']} | {r['stage']} | {r['outcome']} | {count(r['lost'])} | "
                     f"{count(r['duplicated'])} | {count(r['changed'])} | "
                     f"{'-' if w is None else f'{w:.2e}'} | {notes.replace('|', '/')} |")
    readings = ""  # the written readings below the table are kept
    if Path(out + ".md").exists():
        text = Path(out + ".md").read_text()
        readings = text[text.index("\n## Reading"):] if "\n## Reading" in text else ""
    Path(out + ".md").write_text("\n".join(lines) + "\n" + readings)


def meta(ref: dict, args, started: float, partial: bool = False,
         before: dict | None = None) -> dict:
    command = "python benchmarks/fault_matrix.py" + (
        f" --faults {args.faults}" if args.faults != ",".join(FAULTS) else "")
    seconds = time.time() - started
    if before is not None:  # --merge: the earlier invocations' commands and time too
        command = f"{before['command']}`, then `{command} --merge"
        seconds += before["seconds"]
    return {"pipeline": f"Pipeline: {CONFIG.relative_to(ROOT)} with " + ", ".join(
                f"`{s}`" for s in SMALL) + f"; reference: {len(ref['generated'])} conversations, "
                f"{len(ref['cache'])} cache rows." + (" PARTIAL: stopped before the last fault."
                                                      if partial else ""),
            "machine": describe_machine(), "hardware": machine_fields(),
            "date": time.strftime("%Y-%m-%d"), "seconds": seconds, "command": command}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--work", default="/tmp/dspark_fault_matrix",
                        help="scratch directory (deleted first)")
    parser.add_argument("--out", default=None, help=OUT_HELP)
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of other faults already in <out>.json (without --out: "
                        "this machine class's newest fault_matrix run)")
    args = parser.parse_args()
    if args.out is None and args.merge:  # adds to this class's newest run, whatever its date
        args.out = str(latest_stem("fault_matrix") or result_stem("fault_matrix"))
    args.out = args.out or str(result_stem("fault_matrix"))
    names = [n.strip() for n in args.faults.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        print(f"error: unknown fault(s) {unknown}; choose from {list(FAULTS)}", file=sys.stderr)
        return 2
    started = time.time()
    root = Path(args.work)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    ref_run = Run(root, "reference")
    rc = ref_run.run("prompts,generate,cache,train")
    if rc != 0:
        print(f"error: the fault-free run failed:\n{ref_run.tail(40)}", file=sys.stderr)
        return 1
    ref = {"generated": generated(ref_run), "cache": cache_rows(ref_run),
           "weights": weights(ref_run),
           "manifest": json.loads(Path(ref_run.cache_dir, "manifest.json").read_text())}
    earlier, before = [], None
    if args.merge and Path(args.out + ".json").exists():
        old = json.loads(Path(args.out + ".json").read_text())
        earlier = [r for r in old["rows"] if r.get("name") not in names]
        before = old["meta"]
    rows = []
    for name in names:
        t0 = time.time()
        print(f"fault {name} ...", flush=True)
        fn = FAULTS[name]
        try:
            row = fn(root, ref_run, ref) if name in NEEDS_REF_RUN else fn(root, ref)
        except Exception as err:  # noqa: BLE001 - a harness failure is reported, the rest runs
            import traceback

            traceback.print_exc()
            row = {"fault": name, "stage": "-", "injected": False,
                   "outcome": f"harness error: {type(err).__name__}: {err}"[:300], "lost": [],
                   "duplicated": [], "changed": [], "extra": []}
        row["name"], row["seconds"] = name, round(time.time() - t0, 1)
        print(f"  {row['outcome']}; lost {count(row['lost'])}, duplicated "
              f"{count(row['duplicated'])}, changed {count(row['changed'])}", flush=True)
        rows.append(row)
        write_report(earlier + rows, meta(ref, args, started, partial=True, before=before),
                     args.out)  # kept if stopped
    write_report(earlier + rows, meta(ref, args, started, before=before), args.out)
    print(Path(args.out + ".md").read_text())
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    sys.exit(main())
