"""What the rest of the system knows about one drafter type: its :class:`DrafterSpec`.

Every per-type decision (which model class loads a checkpoint, the training objective, where
anchors may start, how a block's slots map to draft tokens, the export formats, how vLLM serves
an export) reads the spec of the config's ``drafter_type``; nothing else branches on the type's
name. Each type defines its spec beside its model (``drafters/dspark.py``, ``dflash.py``,
``eagle3.py``) and ``drafters/registry.py`` registers it once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .options import DrafterOptions

if TYPE_CHECKING:
    import torch

    from .config import BoundDrafterConfig


@dataclass(frozen=True)
class DrafterSpec:
    """One drafter type.

    Attributes:
        name: the ``drafter_type`` that selects it (configs, checkpoints).
        title: its name in messages and documents ("DSpark").
        model_class: the :class:`~drafters.base.DrafterBase` subclass, built as
            ``model_class(config, embed_weight, lm_head_weight, draft_vocab)``.
        objective: its training loss, one of ``drafters.losses.OBJECTIVES``.
        step_weights: per-prediction loss weights of a config: fp32 [block_size].
        min_anchor: the anchor rule, the smallest position a training block may start at (1
            for a drafter whose first draft reads the target state at p-1).
        anchor_slots: the slot convention, block inputs that only condition and predict nothing:
            0 when the anchor's own slot predicts the first draft token (DSpark, Eagle3), 1 when
            the anchor takes a slot of its own before the block_size mask slots (DFlash).
        options: its options model (:class:`~drafters.options.DrafterOptions`), the settings
            it alone has (defined beside its class): which parts it has is which fields its
            options declare (:meth:`has_option`).
        drafts_whole_block: drafts its block in one pass, so a round drafts at most block_size
            tokens in any engine; False for a chained drafter (an engine may run more steps).
        exporters: export format -> :class:`drafters.export.common.Exporter`.
        vllm_method: vLLM's ``speculative_config.method`` for its exports (None: vLLM has none).
        vllm_architectures: markers of its exports' ``architectures`` (substrings), by which a
            served export is recognised (``serve/vllm_app.py``).
    """

    name: str
    title: str
    model_class: type
    objective: str
    step_weights: Callable[[BoundDrafterConfig], torch.Tensor]
    min_anchor: int = 0
    anchor_slots: int = 0
    options: type[DrafterOptions] = DrafterOptions
    drafts_whole_block: bool = True
    exporters: Mapping[str, Any] = field(default_factory=dict)
    vllm_method: str | None = None
    vllm_architectures: tuple[str, ...] = ()

    def has_option(self, name: str) -> bool:
        """Whether this type has option ``name`` (a field of its options model): "head_type"
        and "confidence_head" (the heads), "sliding_window", "anchor_features", "init" (a start
        from the target's layers, ``model_class.init_from_target``)."""
        return name in self.options.model_fields

    def training_objective(self, config: BoundDrafterConfig, override: str | None = None
                           ) -> tuple[str, torch.Tensor]:
        """(loss objective, position weights fp32 [block_size]) of ``config`` (SPEC 3).

        ``override`` (``train.objective``, one of ``drafters.losses.OBJECTIVES``) replaces the
        type's own objective, e.g. DSpark's architecture trained with Eagle3's soft
        cross-entropy; the position weights stay the type's."""
        return override or self.objective, self.step_weights(config)
