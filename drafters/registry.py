"""The drafter types: one registered :class:`~drafters.spec.DrafterSpec` each.

A new drafter type is one new file (its model class, a subclass of
:class:`~drafters.base.DrafterBase`, and its ``SPEC``) plus one line in :data:`BUILT_IN`, or one
:func:`register` call from the code that defines it; configs, training, memory planning, export
and serving then find it by its ``drafter_type``.

The built-in types are named here by the module that defines them and imported on first use:
the drafter config validates against the registry, and a type's module imports the config, so
nothing here imports a type's module when it is itself imported (no import loop in
``drafters/``).
"""

from __future__ import annotations

import importlib
import inspect

from .spec import DrafterSpec

# drafter_type -> the module whose SPEC defines it (imported on first use)
BUILT_IN: dict[str, str] = {"dspark": "drafters.dspark", "dflash": "drafters.dflash",
                            "eagle3": "drafters.eagle3"}
SPECS: dict[str, DrafterSpec] = {}


def check_model_class(spec: DrafterSpec) -> None:
    """Refuse a spec whose model class is not a complete drafter.

    Raises:
        ValueError: the class is no :class:`~drafters.base.DrafterBase`, leaves one of its
            abstract methods out (named), or lacks ``init_from_target`` where its options offer
            ``init`` (a start from the target's layers).
    """
    # lazy: import cycle: base -> config -> registry
    from .base import DrafterBase

    cls = spec.model_class
    if not (inspect.isclass(cls) and issubclass(cls, DrafterBase)):
        raise ValueError(f"drafter_type {spec.name!r}: its model_class {cls!r} is not a "
                         "drafters.base.DrafterBase")
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if spec.has_option("init") and not callable(getattr(cls, "init_from_target", None)):
        missing.append("init_from_target (its options offer init: target_layers)")
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
    _built_in(spec.name)  # a built-in type's name is taken even before its first use
    if SPECS.get(spec.name, spec) is not spec:
        raise ValueError(f"drafter_type {spec.name!r} is already registered")
    check_model_class(spec)
    SPECS[spec.name] = spec
    return spec


def _built_in(name: str) -> DrafterSpec | None:
    """The built-in spec ``name``, imported and checked on its first use (None: not built in)."""
    module = BUILT_IN.get(name)
    if module is None or name in SPECS:
        return SPECS.get(name) if module is not None else None
    spec = importlib.import_module(module).SPEC
    if spec.name != name:
        raise ValueError(f"{module}.SPEC is named {spec.name!r}, registered as {name!r}")
    check_model_class(spec)
    SPECS[name] = spec
    return spec


def all_specs() -> dict[str, DrafterSpec]:
    """Every registered spec by name, the built-in ones first (imported here if not yet)."""
    for name in BUILT_IN:
        _built_in(name)
    return {name: SPECS[name] for name in drafter_types()}


def drafter_types() -> tuple[str, ...]:
    """The registered ``drafter_type`` names: the built-in ones, then in registration order."""
    return tuple(dict.fromkeys([*BUILT_IN, *SPECS]))


def get_spec(drafter_type: str) -> DrafterSpec:
    """The spec of ``drafter_type``.

    Raises:
        ValueError: an unregistered type (the registered ones are named).
    """
    try:
        return _built_in(drafter_type) or SPECS[drafter_type]
    except (KeyError, TypeError):
        names = ", ".join(repr(n) for n in drafter_types())
        raise ValueError(f"drafter_type must be one of {names}, got {drafter_type!r}") from None


def spec_of_export(exported: dict) -> DrafterSpec | None:
    """The type of an exported drafter's ``config.json`` (``python -m drafters.export``, or
    another tool's export in the same layout): by ``speculators_model_type``, else by a marker of
    its type in ``architectures``; None when no registered type vLLM serves matches."""
    archs = exported.get("architectures") or []
    kind = exported.get("speculators_model_type")
    for spec in all_specs().values():
        if spec.vllm_method and (kind == spec.vllm_method or any(
                marker in a for marker in spec.vllm_architectures for a in archs)):
            return spec
    return None
