"""Run the DSpark pipeline: prompts -> generate -> cache -> train -> calibrate -> eval.

Usage::

    python pipeline/run.py --config infra/configs/quickstart.yaml
    python pipeline/run.py --config infra/configs/quickstart.yaml --stages train,eval \\
        --set train.max_steps=50
    python pipeline/run.py --config infra/configs/quickstart.yaml --repair-cache  # damaged shards
    python pipeline/run.py --config infra/configs/smollm2_reference.yaml \\
        --release runs/smollm2_reference/release   # + the shippable drafter (pipeline/release.py)
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python pipeline/run.py --config infra/configs/quickstart.yaml

Each stage writes under the run directory and marks completion with ``_SUCCESS.json``; a complete
stage is skipped on re-run (``--force STAGE`` redoes it), and partially done stages resume.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.release import release

if __name__ == "__main__" and __package__ in (None, ""):
    # run as a script: import the project packages, not sibling modules of this file
    _root = Path(__file__).resolve().parent.parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _root / "pipeline"]
    sys.path.insert(0, str(_root))

import argparse  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

from pipeline import stages, storage  # noqa: E402
from pipeline.config import ConfigError, load_config  # noqa: E402
from pipeline.generate.vllm_backend import VllmNotInstalledError  # noqa: E402
from pipeline.train.driver import TrainingFailedError  # noqa: E402

logger = logging.getLogger("dspark")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="pipeline YAML (see infra/configs/)")
    names = stages.STAGE_NAMES
    parser.add_argument("--stages", default=",".join(names),
                        help=f"comma-separated subset of {','.join(names)} (run in that order)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override a config field (repeatable; value parsed as YAML)")
    parser.add_argument("--force", action="append", default=[], metavar="STAGE",
                        help="delete a stage's outputs and redo it (later stages are redone too; "
                             "repeatable)")
    parser.add_argument("--release", default=None, metavar="DIR",
                        help="after the stages, package the calibrated drafter with its records "
                             "into DIR (python -m pipeline.release; DIR must not exist; relative "
                             "paths resolve against the project root)")
    parser.add_argument("--repair-cache", action="store_true",
                        help="check every cache shard against the manifest's sha256 first and "
                             "rewrite only the damaged ones (with the cache stage)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    wanted = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in wanted + args.force if s not in stages.STAGE_NAMES]
    if unknown:
        print(f"unknown stage(s) {unknown}; choose from {list(stages.STAGE_NAMES)}",
              file=sys.stderr)
        return 2
    ordered = [s for s in stages.STAGE_NAMES if s in wanted]
    release_to = storage.resolve(args.release) if args.release else None
    if release_to and Path(release_to).exists():  # now, not after hours of stages
        print(f"--release {release_to} exists; choose a new directory", file=sys.stderr)
        return 2
    started = time.time()
    try:
        ctx = stages.StageContext.create(cfg)
        missing = [s for s in ("calibrate", "eval")
                   if release_to and s not in ordered and not ctx.marker(s).exists()]
        if missing:
            raise ValueError(f"--release needs the {' and '.join(missing)} stage(s): add them to "
                             "--stages")
        # inputs a later stage reads are checked now: not after hours of the earlier stages, and
        # not after --force has cleared the outputs they would replace
        stages.preflight(ctx, ordered, forced=args.force)
        if any(s in ordered for s in ("cache", "train", "eval")) and "://" in ctx.cache_dir:
            # an unreachable bucket must fail now, not after hours of generation
            storage.check_writable(ctx.cache_dir, cfg.storage_options)
        if args.repair_cache:
            damaged = stages.repair_cache(ctx)
            logger.info("repair: %d damaged shard(s) removed%s", len(damaged),
                        f", rewritten by the cache stage: {damaged}" if damaged else "")
            if damaged and "cache" not in ordered:
                ordered = [s for s in stages.STAGE_NAMES if s in ordered or s == "cache"]
        for name in ordered:
            stages.run_stage(ctx, name, force=name in args.force)
        if release_to:
            info = release(ctx.run_dir, release_to)
            logger.info("released the calibrated drafter to %s (%s parameters in %s)",
                        release_to, f"{info['trainable_parameters']:,}", info["dtype"])
    except (ConfigError, FileNotFoundError, ConnectionError, PermissionError, ValueError,
            TrainingFailedError, VllmNotInstalledError) as err:
        logger.error("%s", err)
        return 1
    logger.info("pipeline finished in %.1f min; run directory %s", (time.time() - started) / 60,
                ctx.run_dir)
    report = ctx.layout.eval_report("md")
    if "eval" in ordered and report.exists():
        print(report.read_text())
    return 0


def exit_now(code: int) -> None:
    """End the process with ``code`` without the interpreter's teardown: with Ray, torch and
    pyarrow loaded, the C++ static destructors sometimes abort ("terminate called without an
    active exception", SIGABRT) after all work is done (measured: 3 of 10 runs of ``--stages cache
    --repair-cache``), which turns a finished run into a failure. Ray is shut down and the logs
    and streams flushed first; every stage has already closed its W&B run and files."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        code = main()
    except SystemExit as done:  # argparse (--help, bad arguments)
        code = done.code if isinstance(done.code, int) else 1
    except BaseException:  # noqa: BLE001 - report it, then leave the same way
        import traceback

        traceback.print_exc()
        code = 1
    exit_now(code)
