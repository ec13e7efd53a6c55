"""Draft models, losses and calibration for speculative decoding (pure PyTorch, no Ray)."""

from .config import DSparkConfig
from .modeling import BlockProposal, DraftContextCache, DSparkDrafter, check_target_compatibility

__all__ = ["DSparkConfig", "DSparkDrafter", "DraftContextCache", "BlockProposal",
           "check_target_compatibility"]
