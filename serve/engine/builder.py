"""The one way to build the speculative engine: load the target, tokenizer and drafter, wrap the
target in a runner, profile what the scheduler needs, and construct :class:`SpecEngine`.

The Ray Serve app, offline evaluation and calibration (through ``serve.engine.decoding``) and the
benchmarks all go through here, so an engine built anywhere is built the same way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from drafters.loading import load_drafter

from .config import EngineConfig
from .core import SpecEngine
from .paths import local_copy
from .profiling import engine_profiles, mark_profile_stale
from .scheduler_registry import scheduler_entry
from .target_loading import eos_token_ids, load_target, load_tokenizer
from .target_runner import TargetRunner


@dataclass
class LoadedModels:
    """What an engine runs on. tokenizer: the target's; model: the target (eval mode, on its
    device); drafter: None for target-only decoding; runner: the target wrapped to return the
    drafter's feature layers; eos: the ids that end generation; drafter_dir: its checkpoint."""

    tokenizer: object
    model: object
    drafter: object | None
    runner: TargetRunner
    eos: list[int]
    drafter_dir: str | None = None


def load_models(target: str, dtype: str, drafter_dir: str | None = None, *,
                allow_name_mismatch: bool = False, device: str | None = None,
                storage_options: dict | None = None) -> LoadedModels:
    """Load the target (``from_pretrained`` name or directory) and, optionally, a drafter trained
    for it.

    Args:
        target: model name or local directory.
        dtype: "auto" (bf16 where native, else fp32: ``drafters/precision.py``), "float32",
            "bfloat16" or "float16" (target and drafter).
        drafter_dir: drafter checkpoint directory (local, or a URL such as ``s3://...`` that is
            downloaded to this node first: ``serve.engine.paths.local_copy``), or None.
        allow_name_mismatch: accept a drafter whose recorded target has another name.
        device: "cpu", "cuda", ...; None = CUDA when visible, else CPU.
        storage_options: s3fs options for a URL ``drafter_dir``.
    Raises:
        FileNotFoundError: target or drafter missing; ValueError: drafter trained for another
        target (``drafters.loading.load_drafter``).
    """
    import torch

    tokenizer = load_tokenizer(target)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_target(target, dtype, device).to(device)
    drafter = None
    if drafter_dir:
        drafter_dir = local_copy(drafter_dir, storage_options)
        drafter = load_drafter(drafter_dir, model, target, dtype=model.dtype,
                               allow_name_mismatch=allow_name_mismatch)
    layers = list(drafter.config.target_layer_ids) if drafter is not None else []
    return LoadedModels(tokenizer, model, drafter, TargetRunner(model, layers),
                        eos_token_ids(tokenizer, model), drafter_dir)


def build_engine(models: LoadedModels, config: EngineConfig, *, drafter=None,
                 profile_dir: str | Path | None = None, tokenizer: bool = True) -> SpecEngine:
    """A :class:`SpecEngine` over ``models`` with ``config``: SPS(B) and the drafter cost are
    loaded from ``profile_dir`` (default: the drafter's directory) or profiled there when the
    scheduler needs them (``serve.engine.profiling.engine_profiles``).

    Args:
        models: from :func:`load_models`.
        config: the engine's knobs; a scheduler that does not speculate ("none") decodes with the
            target alone.
        drafter: use this drafter instead of ``models.drafter`` (same target layers).
        profile_dir: where profiles are stored / reused; None = ``models.drafter_dir``; "" =
            profile without storing (e.g. a second dtype next to a stored profile).
        tokenizer: attach the tokenizer (text and stop strings); False = token ids only.
    Raises:
        ValueError: as :class:`SpecEngine` (layer mismatch, scheduler without a confidence head).
    """
    drafter = drafter if drafter is not None else models.drafter
    if not scheduler_entry(config.scheduler).speculates:
        drafter = None
    directory = profile_dir if profile_dir is not None else models.drafter_dir
    models.runner.attention = config.attention  # profiled as the engine's steps will run
    sps, cost = engine_profiles(models.runner, drafter, config, directory)
    engine = SpecEngine(models.runner, drafter, models.eos, config,
                        models.tokenizer if tokenizer else None, sps, cost)
    # profiles measured here (or loaded as measured here) are checked against the engine's steps
    engine.planner.checks_costs = cost is not None
    if directory:  # a profile the engine's own steps contradict is measured again next start
        engine.on_profile_correction = functools.partial(mark_profile_stale, directory)
    return engine
