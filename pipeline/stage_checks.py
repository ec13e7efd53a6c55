"""What each stage checks before any stage of a run starts (or is cleared by ``--force``): the
inputs it will read, named by their config field when they are missing or wrong. Each
:class:`~pipeline.stages.Stage` names its own check; :func:`pipeline.stages.preflight` calls
the checks of the stages a command asks for.

Every check takes the stage context, whether the stage will run (not complete, or forced) and
whether it is forced.
"""

from __future__ import annotations

from drafters.layer_init import check_drafter_init
from drafters.loading import check_checkpoint
from drafters.target_weights import load_target_config

from . import storage
from .cache.format import read_manifest
from .generate.vllm_backend import require_vllm
from .model_stages import eval_datasets
from .stage_context import StageContext


def _config_files_exist(ctx: StageContext, inputs: list[tuple[str, str]]) -> None:
    """Raises FileNotFoundError / ValueError: a file named in the config is missing, or is a
    directory."""
    for field, path in inputs:
        resolved = storage.resolve(path)
        if not storage.exists(resolved, ctx.cfg.storage_options):
            raise FileNotFoundError(f"{field}: no such file: {path}")
        if storage.get_fsspec(resolved, ctx.cfg.storage_options).isdir(resolved):
            raise ValueError(f"{field}: {path} is a directory; name its files")


def _existing_cache_is_this_targets(ctx: StageContext) -> None:
    """Raises CacheMismatchError: a cache at the cache location belongs to another target."""
    so = ctx.cfg.storage_options
    if storage.exists(storage.join(ctx.cache_dir, "manifest.json"), so):
        ctx.check_cache_target(read_manifest(ctx.cache_dir, so))


def check_prompts(ctx: StageContext, will_run: bool, forced: bool) -> None:
    """The file of ``prompts.heldout_ids_from``."""
    if will_run and ctx.cfg.prompts.heldout_ids_from:
        _config_files_exist(ctx, [("prompts.heldout_ids_from", ctx.cfg.prompts.heldout_ids_from)])


def check_generate(ctx: StageContext, will_run: bool, forced: bool) -> None:
    """vLLM for ``generate.backend: vllm`` (VllmNotInstalledError) and the files of
    ``generate.reuse_from``."""
    if not will_run:
        return
    if ctx.cfg.generate.backend == "vllm":
        require_vllm()
    _config_files_exist(ctx, [(f"generate.reuse_from[{i}]", p)
                              for i, p in enumerate(ctx.cfg.generate.reuse_from)])


def check_cache(ctx: StageContext, will_run: bool, forced: bool) -> None:
    """An existing cache at the cache location belongs to this target (unless forced, which
    deletes it)."""
    if not forced:
        _existing_cache_is_this_targets(ctx)


def check_train(ctx: StageContext, will_run: bool, forced: bool) -> None:
    """``drafter.init: target_layers`` maps the target's layers onto the drafter's
    (LayerInitError; a run from ``train.init_from`` copies no target layer), ``train.init_from``
    is a drafter checkpoint (DrafterCheckpointError), and the cache it reads is this target's."""
    init_from = ctx.cfg.train.init_from
    if will_run and not init_from:
        check_drafter_init(ctx.cfg.drafter, load_target_config(ctx.target), ctx.target,
                           ctx.layer_ids)
    if init_from and not storage.is_url(init_from):
        check_checkpoint(storage.resolve(init_from))
    _existing_cache_is_this_targets(ctx)


def check_eval(ctx: StageContext, will_run: bool, forced: bool) -> None:
    """The benchmark files (EvalDataError)."""
    eval_datasets(ctx.cfg)
