"""Offline vs online vs hybrid training (``train.data_mode``), side by side on the same data.

For one pipeline config (default: the quickstart), the prompts and generate stages run once; then
each mode runs ``cache`` + ``train`` from that generate output in its own run directory, the
modes alternating over ``--rounds`` rounds. Per mode: the cache stage's and the train stage's wall
time (from their completion markers), optimizer steps per second of the whole (cache included:
offline pays for its cache up front, online every epoch), the bytes it stores, and the final
held-out tau and accept_rate@1 (the same data and schedule: they should agree within the noise of
anchor sampling and order), and the share of the train stage a worker spent waiting for its
micro-batches (the feature stream's or the cache reader's).

    .venv/bin/python benchmarks/online_vs_offline.py [--config C] [--max-steps 60] [--rounds 2]

Writes ``benchmarks/results/online_vs_offline/<date>_<machine class>.{md,json}``. Run it on a quiet machine: the arms
compete with anything else for the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.machine import describe as describe_machine, machine as machine_fields  # noqa: E402,I001
from benchmarks.machine import OUT_HELP, result_stem  # noqa: E402
from pipeline.run_layout import CACHE, GENERATE, PROMPTS, TRAIN, RunLayout  # noqa: E402

MODES = ("offline", "online", "hybrid")


def run(config: str, run_dir: Path, stages: str, sets: list[str], log: Path) -> None:
    cmd = [sys.executable, str(ROOT / "pipeline" / "run.py"), "--config", config, "--stages",
           stages, "--set", f"run_dir={run_dir}", *(x for s in sets for x in ("--set", s))]
    with open(log, "a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {proc.returncode}); see {log}")


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def one_arm(config: str, base: Path, work: Path, mode: str, sets: list[str], log: Path) -> dict:
    run_dir = work / mode
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    src, layout = RunLayout(base), RunLayout(run_dir)
    for stage in (PROMPTS, GENERATE):
        shutil.copytree(src.stage_dir(stage), layout.stage_dir(stage))
    start = time.time()
    run(config, run_dir, "cache,train", [*sets, f"train.data_mode={mode}"], log)
    wall = time.time() - start
    cache = json.loads(layout.marker(CACHE).read_text())
    train = json.loads(layout.marker(TRAIN).read_text())
    history = [json.loads(l) for l in layout.training_log.read_text().splitlines()]
    evals = [h for h in history if "heldout_tau" in h]
    return {"mode": mode, "cache_s": cache["seconds"], "train_s": train["seconds"], "wall_s": wall,
            "steps": train["steps"], "steps_per_s": train["steps"] / (cache["seconds"] + train["seconds"]),
            "stored_bytes": tree_bytes(layout.default_cache_dir),
            # rank 0's time waiting for its micro-batches, over the train stage's wall time
            "data_wait_share": sum(h.get("data_wait_s", 0.0) for h in history) / train["seconds"],
            "heldout_tau": evals[-1]["heldout_tau"] if evals else None,
            "heldout_accept_rate@1": evals[-1]["heldout_accept_rate@1"] if evals else None,
            "phases": train.get("phases")}


def summarize(arms: list[dict]) -> list[dict]:
    out = []
    for mode in MODES:
        mine = [a for a in arms if a["mode"] == mode]
        if not mine:
            continue
        row = {"mode": mode, "runs": len(mine)}
        for key in ("cache_s", "train_s", "steps_per_s", "stored_bytes", "data_wait_share",
                    "heldout_tau", "heldout_accept_rate@1"):
            vals = [a[key] for a in mine if a[key] is not None]
            row[key] = statistics.median(vals) if vals else None
        out.append(row)
    base = next((r for r in out if r["mode"] == "offline"), None)
    for r in out:
        r["speed_vs_offline"] = (r["steps_per_s"] / base["steps_per_s"]) if base else None
    return out


def write(rows: list[dict], arms: list[dict], meta: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps({"meta": meta, "summary": rows, "arms": arms},
                                                   indent=1))
    lines = [f"# Offline vs online vs hybrid training (online_vs_offline, measured {meta['date']})",
             "", f"Command: `{meta['command']}`. Machine: {meta['machine']}. Settings: "
             f"{', '.join(f'`{s}`' for s in meta['sets'])}. Modes alternate over "
             f"{meta['rounds']} round(s); medians.", "",
             "| mode | cache stage s | train stage s | steps / s (cache + train) | vs offline | "
             "stored | waiting for data | held-out tau | held-out accept_rate@1 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tau = "-" if r["heldout_tau"] is None else f"{r['heldout_tau']:.3f}"
        acc = "-" if r["heldout_accept_rate@1"] is None else f"{r['heldout_accept_rate@1']:.3f}"
        lines.append(f"| {r['mode']} | {r['cache_s']:.1f} | {r['train_s']:.1f} | "
                     f"{r['steps_per_s']:.3f} | {r['speed_vs_offline']:.2f}x | "
                     f"{r['stored_bytes'] / 1e6:.1f} MB | {r['data_wait_share']:.0%} | {tau} | "
                     f"{acc} |")
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "infra" / "configs" / "quickstart.yaml"))
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="more overrides for every arm")
    parser.add_argument("--work", default="/tmp/dspark_online_vs_offline")
    parser.add_argument("--out", default=None, help=OUT_HELP)
    args = parser.parse_args()
    args.out = args.out or str(result_stem("online_vs_offline"))
    modes = [m for m in args.modes.split(",") if m]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    # from the target's layers (the quickstart itself fine-tunes the shipped drafter)
    sets = ["train.init_from=null", f"train.max_steps={args.max_steps}",
            "train.eval_every=" + str(args.max_steps), "wandb.mode=disabled", *args.set]
    base = work / "base"
    if not RunLayout(base).marker(GENERATE).exists():
        run(args.config, base, "prompts,generate", sets, log)
    started, arms = time.time(), []
    for r in range(args.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):  # alternate the order too
            arms.append(one_arm(args.config, base, work, mode, sets, log))
            print(json.dumps(arms[-1]), flush=True)
    rows = summarize(arms)
    meta = {"date": time.strftime("%Y-%m-%d"), "seconds": time.time() - started,
            "machine": describe_machine(), "hardware": machine_fields(),
            "command": "python benchmarks/online_vs_offline.py " + " ".join(sys.argv[1:]),
            "sets": sets, "rounds": args.rounds}
    write(rows, arms, meta, Path(args.out))
    print(Path(f"{args.out}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
