"""What a drafter config reads of its target: :class:`TargetShape` (the dimensions and feature
layers a checkpoint records, SPEC 2) and :func:`target_layer_windows` (each target layer's
sliding window, which a drafter's ``sliding_window: target`` mirrors)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


def target_layer_windows(target_config) -> list[int | None]:
    """Per decoder layer of a target, the sliding window its attention uses (None = full
    attention, or a layer that is not attention), read from the Hugging Face config as
    transformers states it: ``layer_types`` with ``sliding_window`` (Gemma 2/3, gpt-oss, Qwen2
    and Qwen3 with ``use_sliding_window``), else a model-wide ``sliding_window`` that
    ``use_sliding_window`` does not switch off (Mistral).

    Args:
        target_config: a transformers ``PretrainedConfig`` (or an object with its attributes).
    Returns:
        one entry per ``num_hidden_layers``.
    """
    n = int(target_config.num_hidden_layers)
    window = getattr(target_config, "sliding_window", None)
    types = getattr(target_config, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" and window else None for t in types]
    if window and getattr(target_config, "use_sliding_window", True) is not False:
        return [int(window)] * n
    return [None] * n


class TargetShape(BaseModel):
    """The target a drafter is built for, as its checkpoint records it: the model, its
    vocabulary, the layers whose outputs feed the context features, and the decoder-layer
    dimensions the drafter's own layers copy (SPEC 2)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    name_or_path: str = Field("", description="The target's from_pretrained name or directory.")
    vocab_size: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    layer_ids: list[int] = Field(description="0-based decoder layers whose outputs are "
                                 "concatenated into the context features (ascending; SPEC 1.4).")
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    rms_norm_eps: float = Field(gt=0)
    rope_theta: float = Field(gt=0)
    max_position_embeddings: int = Field(ge=1)

    @field_validator("layer_ids")
    @classmethod
    def _ascending(cls, v: list[int]) -> list[int]:
        if not v or sorted(set(v)) != v or v[0] < 0:
            raise ValueError(f"target_layer_ids must be non-empty, distinct, ascending and >= 0, "
                             f"got {v}")
        return v

    @model_validator(mode="after")
    def _heads(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        return self

    @classmethod
    def of(cls, tc, name: str, layer_ids: list[int]) -> TargetShape:
        """The shape of the target whose Hugging Face config is ``tc``."""
        params = getattr(tc, "rope_parameters", None) or {}
        heads = tc.num_attention_heads
        return cls(name_or_path=name, vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
                   layer_ids=list(layer_ids), num_attention_heads=heads,
                   num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
                   head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
                   intermediate_size=tc.intermediate_size, rms_norm_eps=tc.rms_norm_eps,
                   rope_theta=float(params.get("rope_theta") or getattr(tc, "rope_theta", 10000.0)),
                   max_position_embeddings=tc.max_position_embeddings)
