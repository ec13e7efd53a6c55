"""What one Serve replica loads (no Ray): the target, its tokenizer and the drafter of a
:class:`~serve.config.ServeConfig`, built into a :class:`~serve.engine.core.SpecEngine`
(``serve/app.py`` wraps it in the HTTP deployment).
"""

import logging
import os
import time

from .config import ServeConfig, _is_path
from .engine.builder import build_engine, load_models
from .engine.paths import resolve

logger = logging.getLogger(__name__)


def load_engine(cfg: ServeConfig):
    """Load target, tokenizer and drafter and build the :class:`SpecEngine` (no Ray).

    The SPS(B) table is measured (or reused from ``<drafter>/sps_profile.json`` when its hardware
    fingerprint matches) only for the dspark and async schedulers; ``engine.sps_profile: off``
    assumes SPS constant.

    Returns:
        the engine (its ``tokenizer`` attribute set).
    Raises:
        FileNotFoundError: target or drafter missing (path named).
        ValueError: the drafter was trained for another target (each mismatch named), or the
            scheduler needs a confidence head the drafter lacks.
        RuntimeError: the config asks for a GPU and this process sees none.
    """
    import torch

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    device = cfg.torch_device()
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"this replica asked for num_gpus={cfg.num_gpus} but sees no CUDA device "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, "
                           f"torch {torch.__version__}, CUDA build: {torch.version.cuda})")
    target = resolve(cfg.target) if _is_path(cfg.target) else cfg.target
    models = load_models(target, cfg.dtype, resolve(cfg.drafter) if cfg.drafter else None,
                         allow_name_mismatch=cfg.allow_target_name_mismatch, device=device,
                         storage_options=cfg.storage_options)
    start = time.perf_counter()
    engine = build_engine(models, cfg.engine)
    if engine.sps is not None:
        logger.info("SPS(B) and drafter cost ready in %.1f s", time.perf_counter() - start)
    return engine
