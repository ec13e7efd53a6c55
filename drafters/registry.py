"""The drafter types: one registered :class:`~drafters.spec.DrafterSpec` each.

A new drafter type is one new file (its model class, a subclass of
:class:`~drafters.base.DrafterBase`, and its ``SPEC``) plus one line here, or one
:func:`register` call from the code that defines it; configs, training, memory planning, export
and serving then find it by its ``drafter_type``.
"""

from __future__ import annotations

import inspect

from .base import DrafterBase
from .dflash import SPEC as DFLASH
from .dspark import SPEC as DSPARK
from .eagle3 import SPEC as EAGLE3
from .spec import DrafterSpec

SPECS: dict[str, DrafterSpec] = {}


def check_model_class(spec: DrafterSpec) -> None:
    """Refuse a spec whose model class is not a complete drafter.

    Raises:
        ValueError: the class is no :class:`~drafters.base.DrafterBase`, leaves one of its
            abstract methods out (named), or lacks ``init_from_target`` where the spec sets
            ``target_layer_init``.
    """
    cls = spec.model_class
    if not (inspect.isclass(cls) and issubclass(cls, DrafterBase)):
        raise ValueError(f"drafter_type {spec.name!r}: its model_class {cls!r} is not a "
                         "drafters.base.DrafterBase")
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if spec.target_layer_init and not callable(getattr(cls, "init_from_target", None)):
        missing.append("init_from_target (its spec sets target_layer_init)")
    if missing:
        raise ValueError(f"drafter_type {spec.name!r}: {cls.__name__} does not implement "
                         f"{', '.join(missing)} (drafters/base.py declares what every drafter "
                         "implements)")


def register(spec: DrafterSpec) -> DrafterSpec:
    """Add a drafter type.

    Raises:
        ValueError: another spec is registered under ``spec.name``, or its model class is not a
            complete drafter (:func:`check_model_class`).
    """
    if SPECS.get(spec.name, spec) is not spec:
        raise ValueError(f"drafter_type {spec.name!r} is already registered")
    check_model_class(spec)
    SPECS[spec.name] = spec
    return spec


for _spec in (DSPARK, DFLASH, EAGLE3):
    register(_spec)


def drafter_types() -> tuple[str, ...]:
    """The registered ``drafter_type`` names, in registration order."""
    return tuple(SPECS)


def get_spec(drafter_type: str) -> DrafterSpec:
    """The spec of ``drafter_type``.

    Raises:
        ValueError: an unregistered type (the registered ones are named).
    """
    try:
        return SPECS[drafter_type]
    except (KeyError, TypeError):
        names = ", ".join(repr(n) for n in SPECS)
        raise ValueError(f"drafter_type must be one of {names}, got {drafter_type!r}") from None


def spec_of_export(exported: dict) -> DrafterSpec | None:
    """The type of an exported drafter's ``config.json`` (``python -m drafters.export``, or
    another tool's export in the same layout): by ``speculators_model_type``, else by a marker of
    its type in ``architectures``; None when no registered type vLLM serves matches."""
    archs = exported.get("architectures") or []
    kind = exported.get("speculators_model_type")
    for spec in SPECS.values():
        if spec.vllm_method and (kind == spec.vllm_method or any(
                marker in a for marker in spec.vllm_architectures for a in archs)):
            return spec
    return None
