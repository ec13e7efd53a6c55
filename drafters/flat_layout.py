"""The flat layout of a drafter config (``drafters/options.py`` says what it is): splitting a
flat mapping into the shared fields and the type's options, and writing a config flat again.
``drafters/config.py``'s :class:`~drafters.config.DrafterConfig` reads and dumps through these.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticCustomError

from .options import FLAT_KEYS, DrafterOptions
from .registry import get_spec

# the flat layout's key order (dumps, YAML): as every earlier version wrote it
FLAT_ORDER = ("drafter_type", "num_layers", "eagle3_num_layers", "block_size", "head_type",
              "markov_rank", "qk_norm", "confidence_head", "loss_decay", "init",
              "draft_vocab_size", "sliding_window", "anchor_features")
#: the options every drafter config answers for any type, under the option's name (the type's
#: value, or what a type without it has: no head, full attention, ...)
OPTION_VIEWS = ("head_type", "confidence_head", "anchor_features", "sliding_window", "init")


def split_flat(shared_fields: set[str], data: dict
               ) -> tuple[dict, DrafterOptions | None, dict, list[dict]]:
    """(shared fields, the type's options, keys of other types' options it was given, problems)
    of a raw drafter mapping ``data``: flat, or with a nested ``options`` mapping (or model);
    ``shared_fields`` are the config's own field names. The problems (pydantic line errors,
    each under its flat key): an unknown type, an invalid option value, an option given both
    flat and nested with different values, an option of another type at a value that would
    need a part this type lacks (``drafters/options.py``'s ``FLAT_KEYS``); the options are None
    where there are any."""
    data = dict(data)
    kind = data.get("drafter_type", "dspark")
    try:
        spec = get_spec(kind)
    except (ValueError, TypeError) as err:
        return data, None, {}, [line_error(("drafter_type",), kind, str(err))]
    names = spec.options.flat_names()
    field_of = {flat: name for name, flat in names.items()}
    given = data.pop("options", None) or {}
    given = dict(given.model_dump() if isinstance(given, DrafterOptions) else given)
    elsewhere, errors = {}, []
    for key in [k for k in data if k not in shared_fields]:
        if key in field_of:
            value = data.pop(key)
            if field_of[key] in given and given[field_of[key]] != value:
                errors.append(line_error((key,), value, f"{key} {value!r} differs from "
                                         f"options.{field_of[key]} {given[field_of[key]]!r}"))
            given[field_of[key]] = value
        elif key in FLAT_KEYS:
            value = data.pop(key)
            if FLAT_KEYS[key].accepts(value):
                elsewhere[key] = value
            else:
                errors.append(line_error((key,), value, f"{a_drafter(spec)} "
                                         f"{FLAT_KEYS[key].refusal}"))
    options = None
    try:
        options = spec.options.model_validate(given)
    except ValidationError as err:
        errors += [relocated(e, names) for e in err.errors()]
    return data, (None if errors else options), elsewhere, errors


def relocated(error: dict, names: dict[str, str] | None = None) -> dict:
    """A pydantic error (``ValidationError.errors()``) as a line error to raise again, its first
    location renamed through ``names`` (an option field -> its flat key)."""
    loc = tuple(error["loc"])
    if loc and names:
        loc = (names.get(loc[0], loc[0]), *loc[1:])
    return {"type": error["type"], "loc": loc, "input": error["input"],
            **({"ctx": error["ctx"]} if "ctx" in error else {})}


def line_error(loc: tuple, value: Any, message: str) -> dict:
    """A pydantic line error: ``message`` at ``loc`` for ``value``."""
    return {"type": PydanticCustomError("value_error", "{message}", {"message": message}),
            "loc": loc, "input": value}


def a_drafter(spec) -> str:
    """"a DFlash drafter", "an Eagle3 drafter": a type named in a message."""
    return f"{'an' if spec.title[:1] in 'AEIOU' else 'a'} {spec.title} drafter"


def flat_dump(dumped: dict, options: DrafterOptions, given_elsewhere: dict) -> dict:
    """A config's dump (``dumped``, with its ``options`` entry) written flat: the shared fields,
    the type's options under their flat keys, and every other flat key at the value the config
    was given (``given_elsewhere``) or else the value meaning "no such part", in
    :data:`FLAT_ORDER` (further fields, e.g. a bound config's target, after)."""
    out = {k: v for k, v in dumped.items() if k != "options"}
    mine = options.flat()
    out.update({**{k: key.dump for k, key in FLAT_KEYS.items() if k not in mine},
                **given_elsewhere, **mine})
    order = {k: i for i, k in enumerate(FLAT_ORDER)}
    return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))


def option_view(name: str) -> property:
    """A read-only property: the config's ``options.<name>``, or what a type without that option
    has (``FLAT_KEYS[name].reads``)."""
    return property(lambda self: getattr(self.options, name, FLAT_KEYS[name].reads),
                    doc=f"The options' ``{name}``, or {FLAT_KEYS[name].reads!r} for a type "
                    "without it.")
