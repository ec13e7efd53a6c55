"""Draft models, losses and calibration for speculative decoding (pure PyTorch, no Ray).

Where things live: ``config.py`` (the drafter config), ``registry.py`` (the drafter types, one
spec each: ``spec.py``), ``base.py`` (what every drafter shares), one file per type (``dspark.py``,
``dflash.py``, ``eagle3.py``), ``loading.py`` (build and load by type), ``export/`` (formats other
engines load).
"""

from .base import BlockProposal, DrafterBase, check_target_compatibility
from .config import BoundDrafterConfig, DrafterConfig
from .context_cache import DraftContextCache
from .dspark import DSparkDrafter

__all__ = ["DrafterConfig", "BoundDrafterConfig", "DrafterBase", "DSparkDrafter",
           "DraftContextCache", "BlockProposal", "check_target_compatibility"]
