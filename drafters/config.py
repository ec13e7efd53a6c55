"""Configuration of a drafter checkpoint (a Hugging Face ``PretrainedConfig``).

The config is self-describing in the nanoGPT sense: it names the target model the drafter was trained
against (name, vocabulary, hidden size), the target layers whose hidden states feed the context
features, the block size gamma, the head type and the calibration temperatures, so that a serving
engine can rebuild and validate the drafter from the checkpoint directory alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from transformers import PretrainedConfig

HeadType = Literal["markov", "rnn", "none"]
DrafterType = Literal["dspark", "dflash", "eagle3"]


class DSparkConfig(PretrainedConfig):
    """Config of a DSpark, DFlash or Eagle3 drafter.

    Args:
        drafter_type: ``"dspark"`` (anchor is the first prediction slot, sequential head, confidence
            head; SPEC section 2), ``"dflash"`` (same backbone, CE only, no heads) or ``"eagle3"``
            (one autoregressive layer over [embed; fused target features], gamma chained steps).
        target_name_or_path: the target model this drafter serves (``from_pretrained`` name/path).
        target_vocab_size, target_hidden_size: checked against the serving target on load.
        target_layer_ids: 0-based decoder-layer indices of the target whose outputs are
            concatenated into the context features (ascending; SPEC 1.4).
        block_size: gamma, draft tokens per round.
        num_hidden_layers: drafter decoder layers (default 5).
        hidden_size, num_attention_heads, num_key_value_heads, head_dim, intermediate_size,
        rms_norm_eps, rope_theta, max_position_embeddings: copied from the target (SPEC 2).
        head_type: ``"markov"`` (Eq. 5), ``"rnn"`` (Eq. 6) or ``"none"`` (DFlash).
        markov_rank: r of the low-rank transition W1 W2 (default 256).
        confidence_head: whether c_k (Eq. 7) is predicted.
        calibration_temperatures: per-position STS temperatures T_1..T_gamma (SPEC 4); ``None``
            means uncalibrated (all 1.0).
        loss_decay: denominator of the position weights w_k = exp(-(k-1)/loss_decay); the paper
            uses gamma, the reference repository 4.
        draft_vocab_size: N, the size of the frequency-ranked draft vocabulary the drafter predicts
            in (``drafters/draft_vocab.py``; FR-Spec, EAGLE-3); 0 = the full target vocabulary.
        draft_vocab_sha256: fingerprint of the draft-to-target map stored with the weights
            (``d2t``); the loader rejects a map that does not match it.
    """

    model_type = "dspark_drafter"

    def __init__(
        self,
        drafter_type: DrafterType = "dspark",
        target_name_or_path: str = "",
        target_vocab_size: int = 32000,
        target_hidden_size: int = 256,
        target_layer_ids: list[int] | None = None,
        block_size: int = 7,
        num_hidden_layers: int = 5,
        hidden_size: int = 256,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        head_dim: int | None = None,
        intermediate_size: int = 512,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 4096,
        head_type: HeadType = "markov",
        markov_rank: int = 256,
        confidence_head: bool = True,
        calibration_temperatures: list[float] | None = None,
        loss_decay: float | None = None,
        qk_norm: bool = False,
        draft_vocab_size: int = 0,
        draft_vocab_sha256: str | None = None,
        **kwargs,
    ):
        self.drafter_type = drafter_type
        self.target_name_or_path = target_name_or_path
        self.target_vocab_size = target_vocab_size
        self.target_hidden_size = target_hidden_size
        self.target_layer_ids = list(target_layer_ids if target_layer_ids is not None else [1])
        self.block_size = block_size
        self.num_hidden_layers = num_hidden_layers
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.intermediate_size = intermediate_size
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.head_type = head_type
        self.markov_rank = markov_rank
        self.confidence_head = confidence_head
        self.calibration_temperatures = calibration_temperatures
        self.loss_decay = loss_decay if loss_decay is not None else float(block_size)
        self.qk_norm = qk_norm
        self.draft_vocab_size = int(draft_vocab_size)
        self.draft_vocab_sha256 = draft_vocab_sha256
        super().__init__(**kwargs)
        self.vocab_size = target_vocab_size
        self._validate()

    def _validate(self) -> None:
        check_drafter_kind(self.drafter_type, self.head_type, self.confidence_head,
                           self.block_size)
        if not 0 <= self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(f"draft_vocab_size must be in [0, {self.target_vocab_size}] (0 = the "
                             f"full vocabulary), got {self.draft_vocab_size}")
        ids = list(self.target_layer_ids)
        if not ids or sorted(set(ids)) != ids or ids[0] < 0:
            raise ValueError(f"target_layer_ids must be non-empty, distinct, ascending and >= 0, "
                             f"got {ids}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        temps = self.calibration_temperatures
        if temps is not None and (len(temps) != self.block_size or min(temps) <= 0):
            raise ValueError(f"calibration_temperatures needs {self.block_size} positive values, "
                             f"got {temps}")

    @property
    def num_slots(self) -> int:
        """Block inputs per round: gamma for DSpark (the anchor is the first prediction slot) and
        Eagle3 (gamma chained steps), gamma + 1 for DFlash (the anchor slot only conditions)."""
        return self.block_size + 1 if self.drafter_type == "dflash" else self.block_size

    @property
    def prediction_offset(self) -> int:
        """Index of the first slot whose output predicts a draft token."""
        return 1 if self.drafter_type == "dflash" else 0

    @property
    def draft_vocab_len(self) -> int:
        """Size of the vocabulary the drafter predicts in: N, or V for the full vocabulary."""
        return self.draft_vocab_size or self.target_vocab_size

    @property
    def num_context_layers(self) -> int:
        """m, the number of target layers concatenated into the context features."""
        return len(self.target_layer_ids)


MAX_BLOCK_SIZE = 32  # gamma beyond this is outside what the drafters are built and tested for


def check_drafter_kind(drafter_type: str, head_type: str, confidence_head: bool,
                       block_size: int) -> None:
    """The rules on which heads a drafter type has, and on gamma; shared by the model config and
    the pipeline's ``drafter`` section so both reject the same inputs with the same words.

    Raises:
        ValueError: an unknown type or head, heads on a drafter that has none, a confidence head
            without a sequential head, or block_size outside [1, MAX_BLOCK_SIZE].
    """
    if drafter_type not in ("dspark", "dflash", "eagle3"):
        raise ValueError(f"drafter_type must be 'dspark', 'dflash' or 'eagle3', got "
                         f"{drafter_type!r}")
    if head_type not in ("markov", "rnn", "none"):
        raise ValueError(f"head_type must be 'markov', 'rnn' or 'none', got {head_type!r}")
    if drafter_type != "dspark" and (head_type != "none" or confidence_head):
        raise ValueError(f"a {drafter_type} drafter has no sequential or confidence head: "
                         "set head_type 'none' and confidence_head false")
    if confidence_head and head_type == "none":
        raise ValueError("the confidence head (Eq. 7) reads the sequential head's embedding "
                         "W1[x_{k-1}]: it needs head_type 'markov' or 'rnn'")
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")


class DrafterCheckpointError(ValueError):
    """A drafter directory that cannot be loaded: unreadable or invalid ``config.json``, or
    weights that are damaged, incomplete or of other shapes (the file is named)."""


def read_drafter_config(path) -> DSparkConfig:
    """The :class:`DSparkConfig` of drafter directory ``path``.

    Raises:
        FileNotFoundError: no ``config.json`` in ``path``.
        DrafterCheckpointError: the file is not valid JSON or a field is invalid (file named).
    """
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"no drafter checkpoint (config.json) at {path}")
    try:
        return DSparkConfig.from_pretrained(path)
    except (OSError, ValueError, TypeError) as err:
        raise DrafterCheckpointError(f"{file}: {err}") from err
