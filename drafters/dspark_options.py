"""DSpark's settings (:class:`DSparkOptions`) and those it shares with DFlash, the same backbone
without the heads (:class:`BlockDrafterOptions`): the options models of ``drafters/dspark.py``
and ``drafters/dflash.py`` (``drafters/options.py`` says how options work)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .options import DrafterOptions

HeadType = Literal["markov", "rnn", "none"]


class BlockDrafterOptions(DrafterOptions):
    """The settings of a parallel block drafter over the injected target context (DSpark's
    backbone; DFlash's whole drafter)."""

    num_layers: int = Field(5, ge=1, description="Backbone layers of DSpark/DFlash.")
    init: Literal["random", "target_layers"] = Field(
        "random", description="Backbone start: random, or the target's last num_layers decoder "
        "layers and final norm (W_c = identity on the deepest feature layer).")
    sliding_window: int | Literal["target"] | None = Field(
        "target", description="The attention window of the drafter's layers, in tokens (a block "
        "query at position q sees keys at positions > q - window): 'target' = as the target's "
        "layers the drafter mirrors (its last num_layers decoder layers: a sliding layer gives "
        "its window, any other full attention), an integer = every layer slides with it, null "
        "= full attention.")
    anchor_features: bool = Field(
        False, description="The anchor slot also reads the fused target features of the last "
        "context position p-1, as Eagle3's first draft step does: its input becomes embed(x_p) + "
        "W_a H_ctx[p-1] (W_a starts at zero). The first-slot variant of issue 42; vLLM and "
        "speculators exports refuse it (their anchor reads its embedding only).")


class DSparkOptions(BlockDrafterOptions):
    """DSpark's settings: the block backbone's, and its sequential and confidence heads (DSpark
    paper section 3.1, Eqs. 5-7).

    Raises (on validation):
        ValueError: a confidence head without a sequential head (it reads the head's
            embedding).
    """

    head_type: HeadType = Field("markov", description="DSpark's sequential head: markov (Eq. 5), "
                                "rnn (Eq. 6) or none.")
    markov_rank: int = Field(256, ge=1, description="r of the head's low-rank transition W1 W2.")
    confidence_head: bool = Field(True, description="Predict the confidence c_k (Eq. 7).")

    @model_validator(mode="after")
    def _confidence_reads_the_head(self):
        if self.confidence_head and self.head_type == "none":
            raise ValueError("the confidence head (Eq. 7) reads the sequential head's embedding "
                             "W1[x_{k-1}]: it needs head_type 'markov' or 'rnn'")
        return self
