"""The DFlash drafter: DSpark's parallel KV-injection backbone without the sequential and
confidence heads, trained with cross entropy only (DFlash; SPEC section 2).

Slot convention: the anchor takes a block input of its own that only conditions, followed by
block_size mask inputs (``anchor_slots`` 1: the block pass has block_size + 1 inputs, and the
prediction slots start at 1); DSpark's anchor slot predicts the first draft token itself. Engines
and exports that count DFlash's block by its inputs (z-lab, speculators, vLLM's ``block_size``)
count block_size + 1 (``drafters/export/dflash.py``).
"""

from __future__ import annotations

from .dspark import DSparkDrafter, block_position_weights
from .dspark_options import BlockDrafterOptions
from .export.dflash import EXPORTERS
from .spec import DrafterSpec


class DFlashOptions(BlockDrafterOptions):
    """DFlash's settings: those of DSpark's backbone (layers, start, window, anchor features);
    it has no sequential or confidence head."""


class DFlashDrafter(DSparkDrafter):
    """DFlash drafter: :class:`~drafters.dspark.DSparkDrafter`'s backbone read through the
    spec's slot convention (``config.anchor_slots`` 1), without the sequential and confidence
    heads (its options have none)."""


SPEC = DrafterSpec(
    name="dflash", title="DFlash", model_class=DFlashDrafter, objective="ce",
    step_weights=block_position_weights, anchor_slots=1, options=DFlashOptions,
    exporters=EXPORTERS, vllm_method="dflash", vllm_architectures=("DFlashDraftModel",))
