"""Calibrate stage: Sequential Temperature Scaling of the confidence head on held-out prompts
(DSpark paper section 3.2.1; SPEC section 4).

The trained drafter decodes the held-out prompts (the first user turn of each held-out
conversation) with the real target in the loop. Every round that verified the full block gives,
per position k, the raw confidence logit z_k and the label "draft tokens 1..k were all accepted".
The prompts are split in two seeded halves: temperatures are fitted on one and the before/after
metrics (ECE over 20 bins, AUROC, Brier) are reported on the other, so the reported gain is not
measured on the data it was fitted to. The temperatures are written into a copy of the drafter
checkpoint (``calibration_temperatures`` in config.json), which every later consumer loads.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import numpy as np
from tqdm import tqdm

from drafters.calibration import (
    DEFAULT_MIN_POSITIVES,
    calibration_report,
    sequential_temperature_scaling,
    survival_labels,
)
from drafters.config import read_drafter_config
from drafters.precision import dtype_name
from serve.engine.builder import load_models
from serve.engine.chat import render_prompt_ids
from serve.engine.decoding import SpeculativeDecoder
from serve.engine.profiling import device_name

from .plots import reliability_diagram
from .tau_intervals import prompt_counts, tau_interval

logger = logging.getLogger(__name__)


def collect_rounds(*, target: str, dtype: str, drafter_dir: str, template_kwargs: dict,
                   prompts: list[str], temperature: float, max_new_tokens: int, seed: int,
                   num_threads: int | None, storage_options: dict | None = None) -> dict:
    """Decode ``prompts`` speculatively; return the full-gamma rounds per prompt.

    ``drafter_dir`` may be a URL (``s3://``, read with ``storage_options``): the task fetches it
    on whichever node it runs.

    Returns:
        ``{"gamma", "has_confidence", "rounds": [[(z_1..z_gamma), accepted], ...] per prompt},
        "dtype", "device"}`` (what the logits were measured with, for the engine files).
    """
    import torch

    if num_threads:
        torch.set_num_threads(num_threads)
    # inside a Ray task with eval/calibrate gpus > 0 CUDA is visible: decode there
    models = load_models(target, dtype, drafter_dir, storage_options=storage_options)
    tokenizer, drafter = models.tokenizer, models.drafter
    gamma = drafter.config.block_size
    out = {"gamma": gamma, "has_confidence": drafter.config.confidence_head, "rounds": [],
           "per_prompt": [], "temperature": temperature,
           "dtype": dtype_name(models.runner.dtype), "device": device_name(models.runner.device)}
    # fixed gamma (no scheduler): every round verifies the whole block, so the same decode gives
    # STS its labels and the served tau the eval stage sets beside the trainer's held-out tau
    decoder = SpeculativeDecoder(models.runner, drafter, models.eos)
    for i, text in enumerate(tqdm(prompts, desc="calibrate", unit="prompt", mininterval=5)):
        ids = render_prompt_ids(tokenizer, [{"role": "user", "content": text}], template_kwargs)
        res = decoder.generate(ids, max_new_tokens, temperature, seed + i)
        out["per_prompt"] += prompt_counts([res.rounds])
        if drafter.config.confidence_head:
            out["rounds"].append([(r.confidence_logits, r.accepted) for r in res.rounds
                                  if r.verified == gamma and r.confidence_logits is not None])
    return out


def served_tau(collected: dict) -> dict:
    """The drafter's tau at fixed gamma on the held-out prompts, as served (the target in the
    loop, ``calibrate.temperature``), with its 95 % interval over prompts: ``{"served_tau",
    "served_tau_interval", "served_prompts", "served_temperature"}`` ({} when nothing was
    decoded)."""
    counts = collected.get("per_prompt") or []
    rounds = sum(r for _, r in counts)
    if not rounds:
        return {}
    return {"served_tau": sum(c for c, _ in counts) / rounds,
            "served_tau_interval": tau_interval(counts), "served_prompts": len(counts),
            "served_temperature": collected.get("temperature")}


def fit_and_report(collected: dict, out_dir: Path, drafter_dir: str, seed: int,
                   min_rounds: int = 20) -> dict:
    """Fit STS on half of the prompts, report on the other half, write the calibrated drafter to
    ``out_dir/drafter`` with ``report.json`` and ``reliability.png``.

    With fewer than ``min_rounds`` full-block rounds on either half the drafter is left
    uncalibrated (temperatures 1) and the report says why: a too-small calibration set would fit
    noise, and the pipeline should still finish. Likewise when the fitted temperatures make the
    report half's mean ECE worse than identity temperatures (the fit does not generalise): the
    report keeps the fitted values and both ECEs, the drafter keeps temperatures 1.
    """
    measured = {**{k: collected[k] for k in ("dtype", "device") if k in collected},
                **served_tau(collected)}
    dest = out_dir / "drafter"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(drafter_dir, dest)
    if not collected["has_confidence"]:
        summary = {"calibrated": False, "reason": "the drafter has no confidence head", **measured}
        (out_dir / "report.json").write_text(json.dumps(summary, indent=1))
        return summary
    per_prompt = collected["rounds"]
    order = list(range(len(per_prompt)))
    random.Random(seed).shuffle(order)
    half = len(order) // 2
    split = {"fit": order[:half], "report": order[half:]}
    arrays = {}
    for name, idx in split.items():
        rows = [r for i in idx for r in per_prompt[i]]
        if len(rows) < min_rounds:
            reason = (f"only {len(rows)} full-block rounds on the {name} half (< {min_rounds}): "
                      "raise calibrate.max_prompts or calibrate.max_new_tokens")
            logger.warning("drafter left uncalibrated: %s", reason)
            summary = {"calibrated": False, "reason": reason, **measured}
            (out_dir / "report.json").write_text(json.dumps(summary, indent=1))
            return summary
        arrays[name] = (np.array([r[0] for r in rows]), np.array([r[1] for r in rows]))
    temps = sequential_temperature_scaling(*arrays["fit"], min_positives=DEFAULT_MIN_POSITIVES)
    report = calibration_report(*arrays["report"], temps)
    fit_positives = survival_labels(arrays["fit"][1], arrays["fit"][0].shape[1]).sum(axis=0)
    counts = {"fit_rounds": int(len(arrays["fit"][1])),
              # positions too few fit rounds survived to fit: they keep temperature 1
              "unfitted_positions": [k + 1 for k, n in enumerate(fit_positives)
                                     if n < DEFAULT_MIN_POSITIVES],
              "report_rounds": int(len(arrays["report"][1])),
              "mean_ece_before": report["mean"]["ece_before"],
              "mean_ece_after": report["mean"]["ece_after"]}
    if report["mean"]["ece_after"] > report["mean"]["ece_before"]:
        # a fit that does not beat identity temperatures on prompts it was not fitted on has
        # fitted noise: the drafter keeps temperatures 1 (measured on the quickstart's data: STS
        # raised the report half's ECE from 2.04 % to 2.15 %)
        reason = (f"the fitted temperatures raised the report half's mean ECE from "
                  f"{report['mean']['ece_before']:.4f} to {report['mean']['ece_after']:.4f}: "
                  "identity temperatures kept")
        logger.warning("drafter left uncalibrated: %s", reason)
        summary = {"calibrated": False, "reason": reason, "fitted_temperatures": temps,
                   **counts, **measured, "report": report}
        (out_dir / "report.json").write_text(json.dumps(summary, indent=1))
        return summary
    config = read_drafter_config(dest)
    config.calibration_temperatures = [float(t) for t in temps]  # validated on assignment
    config.save(dest)
    reliability_diagram(*arrays["report"], temps, out_dir / "reliability.png",
                        title="Prefix survival a_k on held-out prompts (report half)")
    summary = {"calibrated": True, "temperatures": temps, **counts, **measured, "report": report}
    (out_dir / "report.json").write_text(json.dumps(summary, indent=1))
    return summary
