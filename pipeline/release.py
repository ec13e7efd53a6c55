"""Package a finished run's calibrated drafter as a small, self-describing release directory (the
one the repository ships for the default target, or one to upload to a model hub):

    python -m pipeline.release --run runs/smollm2_reference --out infra/drafters/smollm2_reference

The run must have finished its calibrate and eval stages. The release holds:

- ``config.json`` (with the calibration temperatures) and ``model.safetensors``: the drafter's
  weights in ``--dtype`` (bf16 by default; integer buffers such as the draft vocabulary map stay
  int64). :func:`drafters.loading.load_drafter` casts them to the dtype it serves in;
- ``draft_vocab.json`` (when the drafter has a draft vocabulary), ``training_config.yaml`` (the
  run's whole pipeline config, checked to be the one every stage up to eval ran under),
  ``cache_summary.json`` (the cache manifest without its per-token frequency table),
  ``training_log.jsonl.gz`` (every step, held-out evaluations included), ``eval_report.md`` /
  ``eval_report.json`` and ``calibration.json`` (the stage records);
- ``release.json``: provenance (source run, git commit, sha256 of the weights, parameters) and
  the held-out numbers of the last evaluation; ``README.md``: a model card generated from them.

Hardware-specific profiles (``sps_profile.json``, ``draft_cost_profile.json``) are left out: a
serving engine measures them on its own machine. Nothing is written unless all of it fits
``--max-mb`` (when given); the directory appears whole (written beside it under a temporary name,
then renamed) or not at all, and an existing one is replaced only with ``--force`` (moved aside
first, deleted once the new one is in place).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from drafters.loading import check_checkpoint

from . import storage
from .cache.format import read_manifest
from .config import ConfigError, load_config
from .run_layout import CALIBRATE, EVAL, STAGE_ORDER, RunLayout
from .stages import stage_fingerprint

# the cache manifest's per-split keys worth keeping (the token frequency table is ~1 MB of ids)
SPLIT_SUMMARY_KEYS = ("rows", "tokens", "supervised_tokens")


class ReleaseError(ValueError):
    """The run cannot be released as asked (a missing stage, an oversized result); names the
    file or option to fix."""


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ReleaseError(f"{path}: unreadable ({type(err).__name__}: {err})") from err


def _display_path(path: Path) -> str:
    """``path`` relative to the checkout when it lies inside it (a shipped release then names
    ``runs/...``, not the packaging machine's absolute path)."""
    root = Path(__file__).resolve().parents[1]
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def _require_stage(run_dir: Path, name: str) -> dict:
    layout = RunLayout(run_dir)
    marker = layout.marker(name)
    if not marker.is_file():
        raise ReleaseError(f"{run_dir}: the {name} stage has not finished ({marker} missing); "
                           f"run `python pipeline/run.py --config {layout.config_file}` first")
    return _read_json(marker)


def _run_config(run_dir: Path, eval_marker: dict):
    """The run's ``config.yaml``, checked against the eval stage's fingerprint (which covers
    every section the stages up to eval read): a later ``run.py`` call with other settings
    rewrites the file, and then it no longer describes the drafter."""
    path = RunLayout(run_dir).config_file
    try:
        cfg = load_config(path)
    except (ConfigError, OSError) as err:
        raise ReleaseError(f"{path}: {err}") from err
    if stage_fingerprint(cfg, EVAL) != eval_marker.get("config_fingerprint"):
        raise ReleaseError(f"{path} is not the config the run's stages ran under (a later "
                           "run.py call with other settings rewrote it); re-run the pipeline with "
                           "the run's config to restore it")
    return cfg


def _cast_weights(src: Path, dst: Path, dtype_name: str) -> tuple[int, str]:
    """Copy a safetensors file with its floating tensors cast to ``dtype_name``; returns the
    parameter count (floating elements) and the sha256 of the written file."""
    import torch
    from safetensors.torch import load_file, save_file

    dtype = getattr(torch, dtype_name)
    state = load_file(str(src))
    out = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    save_file(out, str(dst), metadata={"format": "pt"})
    dst.chmod(0o644)  # safetensors writes 0600; a release is meant to be read by others
    params = sum(v.numel() for v in out.values() if v.is_floating_point())
    return params, hashlib.sha256(dst.read_bytes()).hexdigest()


def cache_summary(manifest: dict) -> dict:
    """The cache manifest (``pipeline.cache.writer``) without per-token tables: format, target,
    layer ids, dtypes, chat template hash, lengths, and rows / tokens / supervised tokens per
    split, plus the draft vocabulary coverage by size."""
    out = {k: v for k, v in manifest.items() if k != "splits"}
    out["splits"] = {name: {k: split[k] for k in SPLIT_SUMMARY_KEYS if k in split}
                     for name, split in manifest.get("splits", {}).items()}
    return out


def last_heldout_evaluation(log_rows: list[dict]) -> dict:
    """The last training-log row with held-out metrics, as ``{"step", "accept_rate@1", "tau",
    ...}`` (the ``heldout_`` prefix dropped); {} when the run never evaluated."""
    for row in reversed(log_rows):
        if "heldout_tau" in row:
            return {"step": row["step"], **{k.removeprefix("heldout_"): v for k, v in row.items()
                                              if k.startswith("heldout_")}}
    return {}


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _macro_taus(report: dict) -> dict:
    """{temperature: macro tau} of an eval report's (or its fixed-gamma pass's) ``domains``."""
    return {t: d.get("macro") for t, d in report.get("domains", {}).items()}


def _model_card(name: str, info: dict, config: dict) -> str:
    heldout = info["heldout"]
    macro, fixed = info["eval_macro_tau"], info["eval_macro_tau_fixed_gamma"]
    lines = [
        f"# {name}",
        "",
        f"A {config['drafter_type']} drafter (block size {config['block_size']}, "
        f"{config['num_hidden_layers']} layers, {config.get('head_type') or 'no'} head, draft "
        f"vocabulary {config.get('draft_vocab_size') or 'full'}) for "
        f"`{Path(config['target_name_or_path']).name}`, packaged by `python -m pipeline.release` "
        f"from `{info['source_run']}` at commit {info['packaged_at_commit'] or 'unknown'}.",
        "",
        f"- weights: {info['trainable_parameters']:,} parameters in {info['dtype']} "
        f"(`model.safetensors`, sha256 {info['weights_sha256'][:16]}...)",
        f"- training data: {info['training_tokens']:,} cached training tokens "
        f"({info['training_supervised_tokens']:,} supervised); `cache_summary.json`",
        (f"- held-out at step {heldout['step']}: accept_rate@1 {heldout['accept_rate@1']:.3f}, "
         f"tau {heldout['tau']:.2f} (teacher-forced blocks, `training_log.jsonl.gz`)"
         if heldout else "- no held-out evaluation during training (`train.eval_every` unset)"),
        "- end-to-end macro tau on the eval stage's benchmark sets, by temperature: "
        + ", ".join(f"T={t}: {v:.2f}" for t, v in macro.items() if v is not None)
        + f" with the {info['eval_scheduler']} scheduler"
        + ("; verifying the whole block every round (fixed gamma, the paper's Table 1 "
           "convention): " + ", ".join(f"T={t}: {v:.2f}" for t, v in fixed.items() if v is not None)
           if fixed else "") + " (`eval_report.md`)",
        "- calibration temperatures (STS): "
        + (", ".join(f"{t:.3g}" for t in config["calibration_temperatures"])
           if config.get("calibration_temperatures") else "identity") + " (`calibration.json`)",
        "",
        "Reproduce: `python pipeline/run.py --config training_config.yaml` (the run's own config), "
        "then `python -m pipeline.release --run <run_dir> --out <dir>`.",
        "",
    ]
    return "\n".join(lines)


def release(run_dir: str | Path, out_dir: str | Path, dtype: str = "bfloat16",
            max_mb: float | None = None, force: bool = False) -> dict:
    """Write the release directory of ``run_dir``'s calibrated drafter to ``out_dir``.

    Args:
        run_dir: a local pipeline run directory whose calibrate and eval stages finished.
        out_dir: the release directory (created; replaced only with ``force``).
        dtype: torch dtype name of the released floating weights ("bfloat16", "float16",
            "float32").
        max_mb: refuse a release larger than this many MB (10^6 bytes), all files together
            (None: no limit).
    Returns:
        the ``release.json`` record.
    Raises:
        ReleaseError: a stage has not finished, the run's config is not the one its stages ran
            under, an unreadable record (file named), ``out_dir`` exists without ``force`` or
            would overlap the run, an unknown dtype, or the release exceeds ``max_mb`` (nothing
            is written then).
        drafters.config.DrafterCheckpointError (a ValueError): the calibrated drafter is damaged.
        FileNotFoundError: the calibrated drafter or the cache manifest is missing.
    """
    run_dir, out_dir = Path(run_dir).resolve(), Path(out_dir).resolve()
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ReleaseError(f"--dtype {dtype!r}: use bfloat16, float16 or float32")
    if out_dir.exists() and not force:
        raise ReleaseError(f"{out_dir} exists; pass --force to replace it")
    layout = RunLayout(run_dir)
    stage_dirs = [layout.stage_dir(name) for name in STAGE_ORDER]
    if (out_dir == run_dir or out_dir in run_dir.parents
            or any(out_dir == d or d in out_dir.parents for d in stage_dirs)):
        raise ReleaseError(f"--out {out_dir} overlaps the run directory {run_dir} or one of its "
                           "stages; choose a directory of its own")
    calibration = _require_stage(run_dir, CALIBRATE)
    eval_marker = _require_stage(run_dir, EVAL)
    cfg = _run_config(run_dir, eval_marker)
    source = layout.drafter(CALIBRATE)
    check_checkpoint(source)

    cache_dir = (storage.resolve(cfg.cache.output) if cfg.cache.output
                 else str(layout.default_cache_dir))
    manifest = read_manifest(cache_dir, cfg.storage_options)
    eval_report = _read_json(layout.eval_report("json"))
    log_path = source / "training_log.jsonl"
    try:
        log_text = log_path.read_text() if log_path.is_file() else ""
        log_rows = [json.loads(line) for line in log_text.splitlines() if line.strip()]
    except ValueError as err:
        raise ReleaseError(f"{log_path}: unreadable ({err})") from err

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    aside = None
    try:
        params, sha = _cast_weights(source / "model.safetensors", tmp / "model.safetensors", dtype)
        shutil.copyfile(source / "config.json", tmp / "config.json")
        if (source / "draft_vocab.json").is_file():
            shutil.copyfile(source / "draft_vocab.json", tmp / "draft_vocab.json")
        shutil.copyfile(layout.config_file, tmp / "training_config.yaml")
        shutil.copyfile(layout.eval_report("md"), tmp / "eval_report.md")
        shutil.copyfile(layout.eval_report("json"), tmp / "eval_report.json")
        (tmp / "calibration.json").write_text(json.dumps(calibration, indent=1) + "\n")
        summary = cache_summary(manifest)
        (tmp / "cache_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        # mtime 0: the same log gives the same bytes, so a re-release adds no new blob to git
        (tmp / "training_log.jsonl.gz").write_bytes(gzip.compress(log_text.encode(), mtime=0))
        train_split = summary["splits"].get("train", {})
        info = {
            "source_run": _display_path(run_dir),
            "packaged_at_commit": _git_commit(),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "dtype": dtype,
            "trainable_parameters": params,
            "weights_sha256": sha,
            "training_tokens": train_split.get("tokens", 0),
            "training_supervised_tokens": train_split.get("supervised_tokens", 0),
            "steps": log_rows[-1]["step"] if log_rows else 0,
            "heldout": last_heldout_evaluation(log_rows),
            "eval_macro_tau": _macro_taus(eval_report),
            "eval_scheduler": eval_report.get("scheduler", "fixed"),
            "eval_macro_tau_fixed_gamma": _macro_taus(eval_report.get("fixed_gamma", {})),
        }
        (tmp / "release.json").write_text(json.dumps(info, indent=1) + "\n")
        config = _read_json(source / "config.json")
        (tmp / "README.md").write_text(_model_card(out_dir.name, info, config))
        size_mb = sum(f.stat().st_size for f in tmp.iterdir()) / 1e6
        if max_mb is not None and size_mb > max_mb:
            raise ReleaseError(f"the release of {source} is {size_mb:.1f} MB, over --max-mb "
                               f"{max_mb} (a smaller --dtype, or a larger --max-mb)")
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        if out_dir.exists() or out_dir.is_symlink():  # --force: keep it until the new one is in
            aside = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
            out_dir.rename(aside / out_dir.name)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if aside is not None and not out_dir.exists():  # put the old release back
            (aside / out_dir.name).rename(out_dir)
            shutil.rmtree(aside, ignore_errors=True)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="run directory (calibrate and eval finished)")
    parser.add_argument("--out", required=True, help="release directory to write")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the floating weights")
    parser.add_argument("--max-mb", type=float, default=None,
                        help="refuse a larger release (the repository ships at most 30)")
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    args = parser.parse_args(argv)
    try:
        info = release(args.run, args.out, args.dtype, args.max_mb, args.force)
    except (ValueError, FileNotFoundError) as err:  # ReleaseError, a damaged checkpoint
        print(f"error: {err}", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in Path(args.out).iterdir()) / 1e6
    print(f"released {args.run} -> {args.out} ({size:.1f} MB, {info['trainable_parameters']:,} "
          f"parameters in {info['dtype']}; held-out {info['heldout']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
