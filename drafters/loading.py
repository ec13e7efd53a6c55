"""Build and load drafters by the ``drafter_type`` their config names (the type's registered
spec gives the model class), and check a checkpoint against the serving target (SPEC section 2:
checkpoints are self-describing HF-style directories)."""

from __future__ import annotations

from pathlib import Path

import torch

from .base import WEIGHTS_NAME, DrafterBase, check_target_compatibility
from .config import BoundDrafterConfig, DrafterCheckpointError, read_drafter_config
from .draft_vocab import fingerprint


def build_drafter(config: BoundDrafterConfig, embed_weight: torch.Tensor,
                  lm_head_weight: torch.Tensor, draft_vocab=None) -> DrafterBase:
    """A freshly initialised drafter of ``config.drafter_type`` bound to the target's tensors;
    ``draft_vocab`` (int64 [N] target ids) is required when ``config.draft_vocab_size`` > 0."""
    if config.draft_vocab_size and draft_vocab is None:
        raise ValueError(f"draft_vocab_size {config.draft_vocab_size} needs the draft vocabulary "
                         "(the cache manifest's token frequency ranking)")
    return config.spec.model_class(config, embed_weight, lm_head_weight, draft_vocab)


def check_checkpoint(path: str | Path) -> BoundDrafterConfig:
    """Read a drafter directory's config and its weights' header without loading the model (a
    cheap check before work that would read it much later, e.g. ``train.init_from``).

    Returns:
        the checkpoint's config.
    Raises:
        FileNotFoundError: no config.json or no weights file at ``path``.
        DrafterCheckpointError (a ValueError): invalid config or unreadable weights (file named).
    """
    from safetensors import safe_open

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


def checkpoint_draft_vocab(path: str | Path) -> list[int] | None:
    """The draft vocabulary stored with a drafter directory's weights (``d2t``, int64 [N] target
    ids, most frequent first), or None for a drafter over the full target vocabulary. Read from the
    weights' ``d2t`` tensor alone (no model is built).

    Raises:
        FileNotFoundError / DrafterCheckpointError: as :func:`check_checkpoint`.
        DrafterCheckpointError: the config names a draft vocabulary the weights do not hold, or one
            whose fingerprint differs from the config's ``draft_vocab_sha256``.
    """
    from safetensors import safe_open

    config = check_checkpoint(path)
    if not config.draft_vocab_size:
        return None
    weights = Path(path) / WEIGHTS_NAME
    with safe_open(str(weights), framework="pt") as fh:
        if "d2t" not in fh.keys():
            raise DrafterCheckpointError(f"{weights}: no d2t tensor, though config.json names a "
                                         f"draft vocabulary of {config.draft_vocab_size}")
        d2t = fh.get_tensor("d2t")
    if fingerprint(d2t) != config.draft_vocab_sha256:
        raise DrafterCheckpointError(f"{weights}: the draft vocabulary map does not match "
                                     "config.json's draft_vocab_sha256")
    return d2t.tolist()


def load_drafter(path: str | Path, target_model, target_name: str,
                 dtype: torch.dtype = torch.float32,
                 allow_name_mismatch: bool = False) -> DrafterBase:
    """Load the drafter directory ``path`` for ``target_model`` (a HF causal LM).

    The target's embedding and LM head are bound to the drafter; the checkpoint's recorded target
    is checked first (model name, vocabulary, hidden size, layer ids; see
    :func:`drafters.base.check_target_compatibility`).

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
    return config.spec.model_class.from_pretrained(path, target_model.get_input_embeddings().weight,
                               target_model.get_output_embeddings().weight, dtype=dtype)
