"""Per-type drafter settings: :class:`DrafterOptions`, the base of every type's options model, and
the flat layout those settings are written in.

Each drafter type declares what it alone has (DSpark's heads, DSpark's and DFlash's sliding window
and target-layer start, each type's layer count) in an options model beside its class
(``drafters/dspark_options.py``, ``dflash.py``, ``eagle3.py``) and names it in its
:class:`~drafters.spec.DrafterSpec`; :class:`~drafters.config.DrafterConfig` keeps what every type
shares and holds one type's options.

The flat layout: the pipeline's ``drafter:`` section, config dumps (stage fingerprints) and a
checkpoint's ``config.json`` write every setting as one flat key, as every earlier version did.
A key of another type's options is accepted only at a value that means this type has no such
part (:data:`FLAT_KEYS`), so a DSpark config turned into an Eagle3 one still loads while a head
asked of a type without heads is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field


class DrafterOptions(BaseModel):
    """The settings one drafter type has and the others lack. Subclasses add fields (each with
    its description) and may write a field under another flat key (:attr:`FLAT_NAMES`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    #: option field -> its key in the flat layout, where they differ (Eagle3's layer count)
    FLAT_NAMES: ClassVar[dict[str, str]] = {}

    # 5: the flat layout's num_layers default, which every type without a field of its own had
    num_layers: int = Field(5, ge=1, description="The drafter's layers.")

    @classmethod
    def flat_names(cls) -> dict[str, str]:
        """Each option field's key in the flat layout."""
        return {name: cls.FLAT_NAMES.get(name, name) for name in cls.model_fields}

    def flat(self) -> dict[str, Any]:
        """These options under their flat keys (JSON-ready values)."""
        names = self.flat_names()
        return {names[k]: v for k, v in self.model_dump(mode="json").items()}


@dataclass(frozen=True)
class FlatKey:
    """How the flat layout treats a key of some type's options for a type that lacks it.

    Attributes:
        accepts: whether a value is accepted (and dropped): the value that means "no such part"
            (no head, no anchor features, a random start, full attention), or any size (an
            integer >= 1) where the key sizes a part the type does not have (the heads' rank,
            another type's layer count).
        dump: what a dump writes for it when the config was not given it (the flat layout's
            value, so dumps of configs made before per-type options keep their keys and values).
        reads: what shared code reads for a type without it, where the config answers the
            key for any type (``drafters/flat_layout.py`` ``OPTION_VIEWS``): no such part.
        refusal: why a value is refused, and the fix ("a DFlash drafter <refusal>").
    """

    accepts: Callable[[Any], bool]
    dump: Any
    reads: Any = None
    refusal: str = "has no such option: leave it out"


_SIZE_REFUSAL = "has no part this sizes; it is still an integer >= 1 (or leave it out)"


def _a_size(value: Any) -> bool:  # what the flat layout's size keys always required
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


#: every flat key of a built-in type's options
FLAT_KEYS: dict[str, FlatKey] = {
    "num_layers": FlatKey(_a_size, 5, refusal=_SIZE_REFUSAL),
    "eagle3_num_layers": FlatKey(_a_size, 1, refusal=_SIZE_REFUSAL),
    "head_type": FlatKey(lambda v: v == "none", "none", "none",
                         "has no sequential head (Eqs. 5-6): set 'none' or leave it out"),
    "markov_rank": FlatKey(_a_size, 256, refusal=_SIZE_REFUSAL),
    "confidence_head": FlatKey(lambda v: v is False, False, False,
                               "has no confidence head (Eq. 7): set false or leave it out"),
    "init": FlatKey(lambda v: v == "random", "random", "random",
                    "has no layers that could start from the target's decoder layers: use "
                    "'random' or leave it out"),
    "sliding_window": FlatKey(lambda v: v is None or v == "target", "target", None,
                              "attends its whole context: set null or 'target', or leave it out"),
    "anchor_features": FlatKey(lambda v: v is False, False, False,
                               "has no anchor slot that could read the last context state: set "
                               "false or leave it out"),
}
