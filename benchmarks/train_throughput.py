"""Drafter training throughput at the quickstart shapes: the landed dense loss vs the chunked loss,
full vocabulary vs a draft vocabulary, side by side in one run.

Each arm runs in its own process (so its peak memory is its own) on the same cache rows of a
finished pipeline run: one DSpark worker's micro-batches (the quickstart's 4 sequences x 32
anchors, bf16 autocast, AdamW, 1 torch thread as each of the quickstart's 2 Ray Train workers
has), a few warm-up steps, then timed optimizer steps. Arms alternate over rounds. Reported per
arm: seconds per micro-batch step, optimizer steps per minute (the quickstart's data-parallel
step is one micro-batch per worker), supervised tokens per second, peak resident memory above the
process's state before the first step. Writes ``benchmarks/results/train_throughput/<date>_<machine class>.{md,json}``.

Arms: ``landed`` (dense [N, K, V] draft and target logits, as before the chunked loss),
``chunked_full`` (chunked loss, full vocabulary), ``chunked_dv<N>`` (chunked, draft vocabulary N),
``recompute_dv<N>`` (the draft side recomputed in backward, as before session 15, while one
chunk now keeps it) and ``unsliced_recompute_dv<N>`` (also each chunk's target logits normalised
whole in fp32 instead of in cache-sized slices: close to the loss path before session 15, which
also used ``log_softmax`` and advanced indexing; ``drafters.losses``) and ``per_call_head_dv<N>``
(the target LM head cast to bf16 and a fresh target-logits tensor at every call, as before the
trainer's ``pipeline.train.worker.TargetHead``; the chunked arms hold one head as the trainer
does, its copy and buffer counted in their peak memory). The steps run in a thread of their own, as Ray Train runs the training loop (glibc gives a
second thread its own malloc arena, which returns freed memory to the kernel differently).

    .venv/bin/python benchmarks/train_throughput.py --config infra/configs/quickstart.yaml
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def landed_batch_losses(model, samples, tc, objective, weights, device, generators, head=None):
    """The loss path as it was before chunking: dense fp32 [N, K, V] draft logits and a
    zero-filled [N, K, V] target-logit tensor (kept here only as the benchmark's reference arm)."""
    import torch

    from drafters.losses import drafter_losses
    from drafters.packing import pack_blocks

    cfg = model.config
    pb = pack_blocks(samples, tc.num_anchors, cfg.block_size, generators).to(device)
    from pipeline.train.worker import uses_bf16

    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=uses_bf16(tc)):
        hidden = model(pb)
        logits, conf = model.draft_logits(hidden, pb.prev_tokens)
        valid = pb.label_valid
        with torch.no_grad():
            head_w = model.lm_head_weight
            target_logits = torch.zeros(*logits.shape[:2], head_w.shape[0], device=device)
            target_logits[valid] = torch.nn.functional.linear(
                pb.target_hidden[valid].to(head_w.dtype), head_w).float()
    return drafter_losses(logits, target_logits, pb.labels, valid, weights, conf,
                          tuple(tc.loss_weights), objective=objective, draft_vocab=model.d2t)


def worker(args) -> dict:
    """One arm: build the drafter, run warm-up + timed steps, print a JSON line."""
    import torch

    from drafters.loading import build_drafter
    from drafters.target_weights import final_logit_softcap, load_frozen_head
    from pipeline.cache.format import read_manifest
    from pipeline.config import load_config
    from pipeline.stages import StageContext
    from pipeline.train.driver import select_draft_vocab
    from pipeline.train.worker import batch_losses, target_head
    from pipeline.train.data import CacheRowIndex, CacheRowReader, row_generator

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = load_config(args.config, args.set)
    ctx = StageContext.create(cfg)
    manifest = read_manifest(ctx.cache_dir, cfg.storage_options)
    vocab_size = 0 if args.arm in ("landed", "chunked_full") else int(args.arm.split("dv")[1])
    drafter = cfg.drafter.model_copy(update={"draft_vocab_size": vocab_size})
    draft_vocab, report = select_draft_vocab(manifest, vocab_size)
    target_cfg, emb, head = load_frozen_head(ctx.target)
    model = build_drafter(drafter.for_target(target_cfg, ctx.target, manifest["layer_ids"]),
                          emb, head, draft_vocab).train()
    tc = cfg.train
    objective, weights = model.config.spec.training_objective(model.config, tc.objective)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=tc.lr,
                            betas=(0.9, 0.95))
    index = CacheRowIndex(ctx.cache_dir, manifest, "train", cfg.storage_options)
    reader = CacheRowReader(index, manifest["target"]["hidden_size"], len(manifest["layer_ids"]))
    mb = tc.micro_batch_size
    batches = [list(range(i * mb, (i + 1) * mb)) for i in range(args.warmup + args.steps)]
    data = [reader.read([r % index.num_rows for r in rows]) for rows in batches]
    loss_fn = landed_batch_losses if args.arm == "landed" else batch_losses
    if "recompute_" in args.arm:  # batch_losses imports it at each call
        import functools

        import drafters.losses

        slices = 1 << 30 if args.arm.startswith("unsliced_") else drafters.losses.TARGET_SLICE_ROWS
        drafters.losses.chunked_drafter_losses = functools.partial(
            drafters.losses.chunked_drafter_losses, recompute=True, target_slice_rows=slices)
    device = torch.device("cpu")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the head counts in the peak
    # one head for the whole run, as each training worker holds (None: one per call; the landed
    # arm computes its target logits itself)
    per_call = args.arm == "landed" or args.arm.startswith("per_call_head_")
    head = None if per_call else target_head(model, tc, final_logit_softcap(target_cfg))
    times, supervised, faults = [], [], []

    def loop():
        torch.set_num_threads(args.threads)
        for i, (rows, samples) in enumerate(zip(batches, data)):
            start, minflt = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            out = loss_fn(model, samples, tc, objective, weights, device,
                          [row_generator(tc.seed, 0, r) for r in rows], head)
            out["loss"].backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - minflt)
                supervised.append(sum(int(s["loss_mask"].sum()) for s in samples))

    thread = threading.Thread(target=loop, name="training")  # as Ray Train's TrainingThread
    thread.start()
    thread.join()
    if len(times) != args.steps:
        raise RuntimeError("the training thread failed (its traceback is above)")
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"arm": args.arm, "step_s": statistics.median(times), "mean_step_s": statistics.fmean(times),
            "steps": len(times), "supervised_tokens_per_s": sum(supervised) / sum(times),
            "peak_rss_delta_mb": (rss1 - rss0) / 1024, "peak_rss_mb": rss1 / 1024,
            "minor_faults_per_step": statistics.median(faults),
            "trainable_parameters": model.num_trainable_parameters(),
            "draft_vocab": report or None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "infra" / "configs" / "quickstart.yaml"))
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--arms", default="landed,chunked_full,chunked_dv8192")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # worker mode
    parser.add_argument("--out", default=None, help="the output files' path without a suffix "
                        "(default: benchmarks/results/train_throughput/<date>_<machine class>)")
    args = parser.parse_args()
    from benchmarks.machine import result_stem  # imports torch: after --help

    args.out = args.out or str(result_stem("train_throughput"))
    if args.arm:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    arms = args.arms.split(",")
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    start = time.time()
    for rnd in range(args.rounds):
        for arm in arms[rnd % len(arms):] + arms[:rnd % len(arms)]:
            cmd = [sys.executable, __file__, "--config", args.config, "--arm", arm,
                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--threads", str(args.threads)] + [x for s in args.set for x in ("--set", s)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            runs[arm].append(json.loads(line[7:]))
            print(f"round {rnd + 1} {arm}: {runs[arm][-1]['step_s']:.2f} s/step", flush=True)
    rows = []
    base = statistics.median(r["step_s"] for r in runs[arms[0]])
    for arm in arms:
        step = statistics.median(r["step_s"] for r in runs[arm])
        rows.append({"arm": arm, "step_s": step, "steps_per_min": 60.0 / step,
                     "speedup_vs_" + arms[0]: base / step,
                     "supervised_tokens_per_s": statistics.median(
                         r["supervised_tokens_per_s"] for r in runs[arm]),
                     "peak_rss_delta_mb": max(r["peak_rss_delta_mb"] for r in runs[arm]),
                     "peak_rss_mb": max(r["peak_rss_mb"] for r in runs[arm]),
                     "minor_faults_per_step": statistics.median(
                         r["minor_faults_per_step"] for r in runs[arm]),
                     "trainable_parameters": runs[arm][0]["trainable_parameters"],
                     "draft_vocab": runs[arm][0]["draft_vocab"], "runs": runs[arm]})
    meta = {"config": args.config, "set": args.set, "rounds": args.rounds, "steps": args.steps,
            "threads": args.threads, "date": time.strftime("%Y-%m-%d"),
            "seconds": round(time.time() - start, 1)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Drafter training throughput (DSpark, {Path(args.config).name}; measured)", "",
             f"{args.rounds} rounds x {args.steps} timed steps per arm (median), arms alternating, "
             f"{args.threads} torch thread(s) per process as each Ray Train worker of the config; "
             f"{meta['date']}.", "",
             f"| arm | s / step | steps / min | speed-up vs {arms[0]} | supervised tokens / s | "
             "peak RSS above start (MB) | minor page faults / step | trainable params |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['step_s']:.2f} | {r['steps_per_min']:.1f} | "
                     f"{r['speedup_vs_' + arms[0]]:.2f}x | {r['supervised_tokens_per_s']:.0f} | "
                     f"{r['peak_rss_delta_mb']:.0f} | {r['minor_faults_per_step']:.0f} | "
                     f"{r['trainable_parameters'] / 1e6:.1f} M |")
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
