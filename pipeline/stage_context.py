"""What every stage shares: the resolved run (:class:`StageContext`: run directory, target, its
layers, the cache location, completion markers) and Ray start-up (:func:`ensure_ray`)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from serve.engine.target_loading import (
    default_layer_ids,
    load_target_config,
    materialize_gguf_target,
)

from . import ray_logs, storage
from .cache.format import check_cache_matches
from .config import PipelineConfig, dump_config
from .run_layout import SPLITS, RunLayout

__all__ = ["SPLITS", "StageContext", "ensure_ray"]
logger = logging.getLogger(__name__)


@dataclass
class StageContext:
    """Resolved paths and target facts shared by the stages."""

    cfg: PipelineConfig
    run_dir: Path
    target: str
    layer_ids: list[int]
    cache_dir: str

    @property
    def layout(self) -> RunLayout:
        """Where every stage's outputs live (:class:`~pipeline.run_layout.RunLayout`)."""
        return RunLayout(self.run_dir)

    @classmethod
    def create(cls, cfg: PipelineConfig) -> "StageContext":
        """Resolve paths, materialise a packaged target if needed, pick the target layers.

        Raises:
            FileNotFoundError: the target cannot be found or loaded (path named).
        """
        run_dir = Path(storage.resolve(cfg.run_dir))
        run_dir.mkdir(parents=True, exist_ok=True)
        RunLayout(run_dir).config_file.write_text(dump_config(cfg))
        target = cfg.target.name_or_path
        if cfg.target.convert_from_gguf is not None:
            src = cfg.target.convert_from_gguf
            target = str(materialize_gguf_target(storage.resolve(target), src.package, src.file))
        elif not storage.is_url(target) and (target.startswith((".", "/", "~"))):
            target = storage.resolve(target)
        tcfg = load_target_config(target)
        layer_ids = cfg.target.layer_ids or default_layer_ids(tcfg.num_hidden_layers,
                                                              cfg.target.num_context_layers)
        if max(layer_ids) >= tcfg.num_hidden_layers:
            raise ValueError(f"target.layer_ids {layer_ids} exceed the target's "
                             f"{tcfg.num_hidden_layers} layers")
        cache_dir = (storage.resolve(cfg.cache.output) if cfg.cache.output
                     else str(RunLayout(run_dir).default_cache_dir))
        return cls(cfg, run_dir, target, layer_ids, cache_dir)

    def drafter_location(self, stage: str) -> str:
        """Where the later stages read ``stage``'s drafter ("train" or "calibrate"): with
        ``train.storage_path`` set (shared storage, e.g. s3:// on a multi-node cluster) the copy
        published there (``<storage_path>/<run name>/published/<stage>``), since Ray may run
        calibration and evaluation on a node that cannot see the driver's disk; else the run
        directory's ``<stage>/drafter``."""
        if self.cfg.train.storage_path:
            return storage.join(storage.resolve(self.cfg.train.storage_path), self.run_dir.name,
                                "published", stage)
        return str(self.layout.drafter(stage))

    def publish_drafter(self, stage: str) -> str:
        """Copy ``<run_dir>/<stage>/drafter`` to :meth:`drafter_location` when that is shared
        storage; returns the location."""
        where = self.drafter_location(stage)
        if self.cfg.train.storage_path:
            storage.upload_dir(self.layout.drafter(stage), where, self.cfg.storage_options)
            logger.info("%s drafter published to %s", stage, where)
        return where

    def stage_dir(self, name: str) -> Path:
        """Stage ``name``'s directory, created."""
        path = self.layout.stage_dir(name)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def marker(self, name: str) -> Path:
        """Stage ``name``'s completion marker."""
        return self.layout.marker(name)

    def require(self, name: str) -> None:
        """Raise FileNotFoundError unless stage ``name`` has completed in this run directory."""
        if not self.marker(name).exists():
            raise FileNotFoundError(f"stage {name!r} has not completed in {self.run_dir}; run it "
                                    f"first (--stages {name},...)")

    def check_cache_target(self, manifest: dict) -> None:
        """Raise CacheMismatchError when the cache at ``cache_dir`` (its ``manifest``) belongs to
        another target."""
        tcfg = load_target_config(self.target)
        check_cache_matches(manifest, self.cache_dir, target=self.cfg.target.name_or_path,
                            hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size,
                            layer_ids=self.layer_ids)


_ray_started = False


def ensure_ray(cfg: PipelineConfig) -> None:
    """Join the cluster named by ``ray.address`` / ``RAY_ADDRESS`` (as inside ``ray job submit``),
    or start a local Ray in-process."""
    global _ray_started
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        # Ray Data needs CPU slots to read the cache while every trainer holds one: a local Ray
        # gets two logical CPUs more than the machine has unless the config says otherwise
        num_cpus = cfg.ray.num_cpus or (os.cpu_count() or 1) + 2
        try:
            # no dashboard (~1 GB in ten processes); the runtime env's worker hook drops the
            # warning Ray Train's placement-group cleaner logs every second without one
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True,
                     runtime_env=ray_logs.LOCAL_RUNTIME_ENV)
        except ValueError as err:  # a `ray start` cluster runs here: join it as it is
            if "existing cluster" not in str(err):
                raise
            logger.info("joining the Ray cluster already running on this machine")
            ray.init(log_to_driver=True)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # stages print their own progress
    # the memory-issue detector warns every 30 s about model-holding actors; the stages size
    # their actors explicitly, so the warning is noise here
    ctx.issue_detectors_config.detectors = []
    # a generate or cache batch may legitimately run longer than Ray Data's 30-minute
    # no-progress limit (1,024 answers of 512 tokens on two cores took > 30 min and the stage
    # was failed with ExecutionTimeoutError); the stages' own retries and resume handle failures
    if "RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S" not in os.environ:
        ctx.execution_no_progress_timeout_s = -1
    _ray_started = True
