"""The drafter's configuration: one pydantic schema for the pipeline's ``drafter:`` section and for
every drafter checkpoint's ``config.json``.

:class:`DrafterConfig` is what a user chooses (type, block size, layers, heads, draft vocabulary);
the pipeline config holds it as its ``drafter`` section. :meth:`DrafterConfig.for_target` binds it
to the target it is built for: a :class:`BoundDrafterConfig` is the same fields plus the target's
shape (:class:`TargetShape`) and what training and calibration add (the draft-vocabulary
fingerprint, the STS temperatures). A drafter model holds one and its checkpoint records it, so a
serving engine rebuilds and validates the drafter from the checkpoint directory alone (SPEC
section 2). What a type alone has (DSpark's heads, a sliding window, its layer count) is its
options model, defined beside the type and named by its :class:`~drafters.spec.DrafterSpec`
(``drafters/options.py``); per-type rules (slot convention, anchors, objective) come from the spec
(``drafters/registry.py``).

``config.json`` keeps the flat layout every version of this project wrote (``target_vocab_size``,
``num_hidden_layers``, ...), so checkpoints of earlier versions load as they are.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializeAsAny,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from .flat_layout import (
    OPTION_VIEWS,
    a_drafter,
    flat_dump,
    option_view,
    relocated,
    split_flat,
)
from .options import FLAT_KEYS, DrafterOptions
from .registry import drafter_types, get_spec
from .target_shape import TargetShape, target_layer_windows

if TYPE_CHECKING:
    from .spec import DrafterSpec

MAX_BLOCK_SIZE = 32  # block sizes beyond this are outside what the drafters are built and tested for
QK_NORM_TARGETS = ("qwen3", "qwen3_moe")  # target model types whose attention normalises q and k
MODEL_TYPE = "dspark_drafter"  # config.json's model_type of a drafter checkpoint


class DrafterConfig(BaseModel):
    """A drafter as the user configures it (the pipeline's ``drafter`` section): what every
    type shares, and the settings its type alone has in ``options`` (the type's
    :class:`~drafters.options.DrafterOptions` model, named by its spec).

    Written flat, as every earlier version did: a type's options sit beside the shared fields
    (``num_layers: 2``, ``head_type: rnn``), a nested ``options:`` mapping is accepted too, and
    dumps are flat (``drafters/options.py`` says which keys of other types are accepted). What
    shared code asks of any type's options reads as a property under the option's name
    (``head_type``, ``confidence_head``, ``anchor_features``, ``sliding_window``, ``init``): the
    option's value, or what a type without it has (no head, full attention, ...).

    Raises (on validation):
        pydantic.ValidationError: an unknown type, an invalid value (the flat key named), an
            option of another type at a value that would need a part this type lacks, or a
            rule across fields (below).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    drafter_type: str = Field("dspark", description="A registered drafter type "
                              "(drafters/registry.py): dspark, dflash or eagle3.")
    block_size: int = Field(7, description=f"Draft tokens per block (gamma), 1..{MAX_BLOCK_SIZE}.")
    qk_norm: bool | None = Field(None, description="RMSNorm on each head's queries and keys in "
                                 "the drafter's layers; None = as the target (Qwen3 yes, Llama "
                                 "no). vLLM's DSpark and DFlash drafters are Qwen3-based: set true "
                                 "to export a Llama-target drafter with drafters.export --format "
                                 "vllm.")
    loss_decay: float | None = Field(None, gt=0, description="w_k = exp(-(k-1)/decay); None = "
                                     "block_size (paper); the reference repository uses 4.")
    draft_vocab_size: int = Field(0, ge=0, description="N most frequent supervised target tokens "
                                  "(the cache manifest's ranking) the drafter predicts in; "
                                  "0 = the full target vocabulary.")
    options: SerializeAsAny[DrafterOptions] = Field(
        description="The type's own settings (its spec's options model); written flat.")
    # keys of other types' options this config was given (at values it accepts): kept only so
    # that its dumps, which fingerprint stages, stay what earlier versions wrote
    _given_elsewhere: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _options_of_the_type(cls, data: Any, handler):
        if not isinstance(data, dict):
            return handler(data)
        shared, options, elsewhere, errors = split_flat(set(cls.model_fields), data)
        if errors:  # the shared fields' problems too, so that one message lists them all
            try:
                placeholder = get_spec(shared.get("drafter_type", "dspark")).options()
                handler({**shared, "options": placeholder})
            except ValidationError as err:
                errors += [relocated(e) for e in err.errors()]
            except (KeyError, ValueError):  # an unknown type: named already
                pass
            raise ValidationError.from_exception_data(cls.__name__, errors)
        config = handler({**shared, "options": options})
        config._given_elsewhere = elsewhere
        return config

    @model_serializer(mode="wrap")
    def _flat(self, handler):
        return flat_dump(handler(self), self.options, self._given_elsewhere)

    def __eq__(self, other: object) -> bool:
        # the keys of other types' options a config was given build nothing: two configs of
        # the same fields are the same drafter
        return type(self) is type(other) and self.__dict__ == other.__dict__

    __hash__ = None  # mutable, as every pydantic model that is not frozen

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, v: int) -> int:
        if not 1 <= v <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {v}")
        return v

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False):
        """A copy; an ``update`` that touches the type or its options (``drafter_type``,
        ``options`` or a flat option key) is validated as a new config, so the options stay
        the type's (pydantic's plain copy would set them unchecked)."""
        if update and set(update) & {"drafter_type", "options", *FLAT_KEYS}:
            current = self.model_dump()
            if "options" in update:  # replaced as a whole: not merged with the current ones
                for flat in self.spec.options.flat_names().values():
                    current.pop(flat, None)
            return type(self).model_validate({**current, **update})
        return super().model_copy(update=update, deep=deep)

    # the two field validators below matter on assignment, which bypasses the routing above
    # (and where a failing model validator would leave the assigned value in place)
    @field_validator("drafter_type")
    @classmethod
    def _registered_and_matching(cls, v: str, info: ValidationInfo) -> str:
        spec = get_spec(v)  # raises naming the registered types
        current = info.data.get("options")
        if current is not None and type(current) is not spec.options:
            raise ValueError(f"{a_drafter(spec)}'s options are {spec.options.__name__}, not "
                             f"{type(current).__name__}: build a new config to change the type")
        return v

    @field_validator("options", mode="before")
    @classmethod
    def _the_types_options(cls, v: Any, info: ValidationInfo) -> Any:
        kind = info.data.get("drafter_type")
        if kind is None or type(v) is get_spec(kind).options:  # an invalid type is named
            return v
        if isinstance(v, DrafterOptions):
            raise ValueError(f"{a_drafter(get_spec(kind))}'s options are "
                             f"{get_spec(kind).options.__name__}, not {type(v).__name__}")
        return get_spec(kind).options.model_validate(v)

    @model_validator(mode="after")
    def _window_holds_a_block(self):
        if isinstance(self.sliding_window, int) and self.sliding_window < self.num_block_inputs:
            raise ValueError(f"sliding_window {self.sliding_window} is shorter than one block "
                             f"pass ({self.num_block_inputs} inputs): a block query would not "
                             "see its own block")
        return self

    # ------------------------------------------------------------------ derived from the spec
    @property
    def spec(self) -> DrafterSpec:
        """The registered :class:`~drafters.spec.DrafterSpec` of ``drafter_type``."""
        return get_spec(self.drafter_type)

    @property
    def num_hidden_layers(self) -> int:
        """The drafter's layer count (its options' ``num_layers``)."""
        return self.options.num_layers

    @property
    def anchor_slots(self) -> int:
        """Block inputs that only condition (0, or 1 for DFlash's anchor): the first
        prediction slot's index (the spec's slot convention)."""
        return self.spec.anchor_slots

    @property
    def num_block_inputs(self) -> int:
        """Inputs of one block pass (S), the anchor included: block_size + anchor_slots."""
        return self.block_size + self.spec.anchor_slots

    def for_target(self, target_config, target_name: str, layer_ids: list[int]) -> BoundDrafterConfig:
        """This drafter bound to a target: its shape from the target's Hugging Face config (or
        any object with its attributes), ``qk_norm`` None resolved to the target's own (Qwen3
        yes) and ``loss_decay`` None to ``block_size``. The one place target dimensions enter a
        drafter config.

        Raises:
            ValueError: the bound config is invalid (e.g. a draft vocabulary larger than the
                target's, layer ids not ascending).
        """
        target = TargetShape.of(target_config, target_name, layer_ids)
        windows = self.layer_windows_for(target_config)
        qk_norm = (self.qk_norm if self.qk_norm is not None
                   else getattr(target_config, "model_type", "") in QK_NORM_TARGETS)
        loss_decay = self.loss_decay if self.loss_decay is not None else float(self.block_size)
        fields = {name: getattr(self, name) for name in DrafterConfig.model_fields}
        return BoundDrafterConfig(**{**self._given_elsewhere, **fields, "qk_norm": qk_norm,
                                     "loss_decay": loss_decay},
                                  target=target, layer_windows=windows)

    def layer_windows_for(self, target_config) -> list[int | None] | None:
        """Each drafter layer's attention window (None = full) under ``sliding_window``, or None
        when every layer attends fully. 'target' mirrors the target's last
        ``num_hidden_layers`` layers (:func:`target_layer_windows`); a type without the option
        (Eagle3) always attends fully.

        Raises:
            ValueError: a mirrored target window shorter than one block pass."""
        n = self.num_hidden_layers
        if self.sliding_window is None:
            return None
        if isinstance(self.sliding_window, int):
            return [self.sliding_window] * n
        mirrored = target_layer_windows(target_config)[-n:]
        mirrored = [None] * (n - len(mirrored)) + mirrored  # a drafter deeper than its target
        if all(w is None for w in mirrored):
            return None
        short = [w for w in mirrored if w is not None and w < self.num_block_inputs]
        if short:
            raise ValueError(f"sliding_window 'target': the target's window {short[0]} is "
                             f"shorter than one block pass ({self.num_block_inputs} inputs); set "
                             "the drafter's sliding_window explicitly (or null)")
        return mirrored


for _name in OPTION_VIEWS:
    setattr(DrafterConfig, _name, option_view(_name))


# config.json key -> TargetShape field (the flat checkpoint layout)
_TARGET_KEYS = {"target_name_or_path": "name_or_path", "target_vocab_size": "vocab_size",
                "target_hidden_size": "hidden_size", "target_layer_ids": "layer_ids",
                "num_attention_heads": "num_attention_heads",
                "num_key_value_heads": "num_key_value_heads", "head_dim": "head_dim",
                "intermediate_size": "intermediate_size", "rms_norm_eps": "rms_norm_eps",
                "rope_theta": "rope_theta", "max_position_embeddings": "max_position_embeddings"}
# config.json fields of DrafterConfig (the layer count goes as num_hidden_layers)
_DRAFTER_KEYS = ("drafter_type", "block_size", "head_type", "markov_rank", "confidence_head",
                 "qk_norm", "loss_decay", "draft_vocab_size", "sliding_window", "layer_windows",
                 "anchor_features")
# bookkeeping keys transformers' PretrainedConfig wrote beside ours (ignored on reading)
_HF_KEYS = ("transformers_version", "architectures", "dtype", "torch_dtype", "_name_or_path")


def _target_field(name: str) -> property:
    """A read/write view of ``self.target.<name>``."""
    return property(lambda self: getattr(self.target, name),
                    lambda self, value: setattr(self.target, name, value))


class BoundDrafterConfig(DrafterConfig):
    """A :class:`DrafterConfig` bound to its target (:meth:`DrafterConfig.for_target`): what a
    drafter model holds and its checkpoint's ``config.json`` records. The target's dimensions
    also read (and assign) under their config.json names: ``target_vocab_size``,
    ``target_layer_ids``, ``hidden_size``, ``num_attention_heads``, ``head_dim``, ... (below the
    class)."""

    target: TargetShape
    calibration_temperatures: list[float] | None = Field(
        None, description="Per-position STS temperatures T_1..T_gamma (SPEC 4), written by the "
        "calibrate stage; None = uncalibrated (all 1.0).")
    draft_vocab_sha256: str | None = Field(None, description="Fingerprint of the draft-to-target "
                                           "map stored with the weights (d2t).")
    layer_windows: list[int | None] | None = Field(
        None, description="Each drafter layer's attention window in tokens (None = full), as "
        "``sliding_window`` resolved against the target; None = full attention everywhere.")

    @model_validator(mode="after")
    def _bound(self):
        if not 0 <= self.draft_vocab_size <= self.target.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [0, {self.target.vocab_size}] (0 = the "
                             f"full vocabulary), got {self.draft_vocab_size}")
        windows = self.layer_windows
        if windows is not None and (len(windows) != self.num_hidden_layers or any(
                w is not None and w < self.num_block_inputs for w in windows)):
            raise ValueError(f"layer_windows needs {self.num_hidden_layers} entries, each null or "
                             f">= {self.num_block_inputs} (one block pass), got {windows}")
        temps = self.calibration_temperatures
        if temps is not None and (len(temps) != self.block_size or min(temps) <= 0):
            raise ValueError(f"calibration_temperatures needs {self.block_size} positive values, "
                             f"got {temps}")
        return self

    @property
    def draft_vocab_len(self) -> int:
        """Size of the vocabulary the drafter predicts in: N, or V for the full vocabulary."""
        return self.draft_vocab_size or self.target.vocab_size

    @property
    def num_context_layers(self) -> int:
        """m, the number of target layers concatenated into the context features."""
        return len(self.target.layer_ids)

    # ------------------------------------------------------------------ config.json
    def to_json_dict(self) -> dict:
        """The checkpoint's ``config.json`` content (flat; keys as every version wrote them)."""
        flat = self.model_dump(mode="json")
        out = {k: flat[k] for k in _DRAFTER_KEYS}
        out.update({k: getattr(self.target, f) for k, f in _TARGET_KEYS.items()})
        out.update(model_type=MODEL_TYPE, num_hidden_layers=self.num_hidden_layers,
                   hidden_size=self.target.hidden_size, vocab_size=self.target.vocab_size,
                   calibration_temperatures=self.calibration_temperatures,
                   draft_vocab_sha256=self.draft_vocab_sha256)
        if not self.anchor_features:  # written only when set, so a plain drafter's config.json
            del out["anchor_features"]  # stays readable by versions that predate the field
        return out

    @classmethod
    def from_json_dict(cls, data: dict) -> BoundDrafterConfig:
        """Parse a checkpoint's ``config.json`` content.

        Raises:
            ValueError: another model type, a drafter hidden size unlike its target's, or an
                invalid field (pydantic's message names it).
        """
        data = {k: v for k, v in data.items() if k not in _HF_KEYS}
        model_type = data.pop("model_type", MODEL_TYPE)
        if model_type != MODEL_TYPE:
            raise ValueError(f"model_type {model_type!r} is not a dspark-ray drafter "
                             f"({MODEL_TYPE!r})")
        data.pop("vocab_size", None)  # = target_vocab_size
        hidden = data.pop("hidden_size", None)
        if hidden is not None and hidden != data.get("target_hidden_size"):
            raise ValueError(f"hidden_size {hidden} differs from target_hidden_size "
                             f"{data.get('target_hidden_size')}: the drafter's layers have the "
                             "target's width")
        target = {f: data.pop(k) for k, f in _TARGET_KEYS.items() if k in data}
        kind = data.get("drafter_type", "dspark")
        layers = data.pop("num_hidden_layers", None)
        if layers is not None and kind in drafter_types():
            data[get_spec(kind).options.flat_names()["num_layers"]] = layers
        data.setdefault("qk_norm", False)  # written since qk_norm exists; before, no q/k norms
        data.setdefault("sliding_window", None)  # written since windows exist; before, full
        if data.get("loss_decay") is None and isinstance(data.get("block_size"), int):
            data["loss_decay"] = float(data["block_size"])
        return cls(**data, target=target)

    def save(self, path: str | Path) -> None:
        """Write ``config.json`` into the directory ``path``."""
        (Path(path) / "config.json").write_text(
            json.dumps(self.to_json_dict(), indent=2, sort_keys=True) + "\n")


# the target's dimensions under the names the model code and config.json use (the drafter's
# layers copy the target's decoder-layer shapes, SPEC 2; hidden_size is the drafter's width):
# read/write views of ``config.target``
for _key, _field in {**_TARGET_KEYS, "hidden_size": "hidden_size"}.items():
    setattr(BoundDrafterConfig, _key, _target_field(_field))


class DrafterCheckpointError(ValueError):
    """A drafter directory that cannot be loaded: unreadable or invalid ``config.json``, or
    weights that are damaged, incomplete or of other shapes (the file is named)."""


def read_drafter_config(path) -> BoundDrafterConfig:
    """The :class:`BoundDrafterConfig` of drafter directory ``path``.

    Raises:
        FileNotFoundError: no ``config.json`` in ``path``.
        DrafterCheckpointError: the file is not valid JSON or a field is invalid (file named).
    """
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"no drafter checkpoint (config.json) at {path}")
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise DrafterCheckpointError(f"{file}: not a valid JSON file ({err})") from err
    if not isinstance(data, dict):
        raise DrafterCheckpointError(f"{file}: not a JSON object")
    try:
        return BoundDrafterConfig.from_json_dict(data)
    except (ValidationError, ValueError, TypeError) as err:
        raise DrafterCheckpointError(f"{file}: {err}") from err
