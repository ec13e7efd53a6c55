"""Load any drafter checkpoint by the ``drafter_type`` its config names, and check it against the
serving target (SPEC section 2: checkpoints are self-describing HF directories)."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import DrafterCheckpointError, DSparkConfig, read_drafter_config
from .modeling import DrafterBase, DSparkDrafter, check_target_compatibility


def drafter_class(drafter_type: str) -> type[DrafterBase]:
    """The model class of a ``drafter_type``.

    Raises:
        ValueError: unknown type (the valid ones are named).
    """
    if drafter_type in ("dspark", "dflash"):
        return DSparkDrafter
    if drafter_type == "eagle3":
        from .eagle3 import Eagle3Drafter

        return Eagle3Drafter
    raise ValueError(f"unknown drafter_type {drafter_type!r}; expected dspark, dflash or eagle3")


def build_drafter(config: DSparkConfig, embed_weight: torch.Tensor,
                  lm_head_weight: torch.Tensor, draft_vocab=None) -> DrafterBase:
    """A freshly initialised drafter of ``config.drafter_type`` bound to the target's tensors;
    ``draft_vocab`` (int64 [N] target ids) is required when ``config.draft_vocab_size`` > 0."""
    if config.draft_vocab_size and draft_vocab is None:
        raise ValueError(f"draft_vocab_size {config.draft_vocab_size} needs the draft vocabulary "
                         "(the cache manifest's token frequency ranking)")
    return drafter_class(config.drafter_type)(config, embed_weight, lm_head_weight, draft_vocab)


def check_checkpoint(path: str | Path) -> DSparkConfig:
    """Read a drafter directory's config and its weights' header without loading the model (a
    cheap check before work that would read it much later, e.g. ``train.init_from``).

    Returns:
        the checkpoint's config.
    Raises:
        FileNotFoundError: no config.json or no weights file at ``path``.
        DrafterCheckpointError (a ValueError): invalid config or unreadable weights (file named).
    """
    from safetensors import safe_open

    from .modeling import WEIGHTS_NAME

    path = Path(path)
    config = read_drafter_config(path)
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"no drafter weights ({WEIGHTS_NAME}) at {path}")
    try:
        with safe_open(str(weights), framework="pt") as fh:
            fh.keys()
    except Exception as err:  # safetensors' own error type
        raise DrafterCheckpointError(f"{weights}: damaged ({type(err).__name__}: {err})") from err
    return config


def load_drafter(path: str | Path, target_model, target_name: str,
                 dtype: torch.dtype = torch.float32,
                 allow_name_mismatch: bool = False) -> DrafterBase:
    """Load the drafter directory ``path`` for ``target_model`` (a HF causal LM).

    The target's embedding and LM head are bound to the drafter; the checkpoint's recorded target
    is checked first (model name, vocabulary, hidden size, layer ids; see
    :func:`drafters.modeling.check_target_compatibility`).

    Raises:
        FileNotFoundError: no drafter checkpoint at ``path``.
        DrafterCheckpointError (a ValueError): invalid config or damaged weights (file named).
        ValueError: the checkpoint was trained for another target (every mismatch named).
    """
    path = Path(path)
    config = read_drafter_config(path)
    tc = target_model.config
    check_target_compatibility(config, target_name, tc.vocab_size, tc.hidden_size,
                               tc.num_hidden_layers, allow_name_mismatch)
    cls = drafter_class(config.drafter_type)
    return cls.from_pretrained(path, target_model.get_input_embeddings().weight,
                               target_model.get_output_embeddings().weight, dtype=dtype)
