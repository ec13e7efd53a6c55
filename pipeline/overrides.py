"""Overrides and error messages of the typed configs: ``--set section.field=value`` parsed as
YAML and set into the raw mapping, and pydantic's validation errors listed one dotted field per
line (``pipeline/config.py`` loads and validates).
"""

from __future__ import annotations

import json
from typing import Any

import yaml
from pydantic import ValidationError


class ConfigError(ValueError):
    """A config file or override is invalid; the message lists every offending field."""


def set_dotted(raw: dict, dotted: str, value: Any) -> None:
    """Set ``raw[a][b]... = value`` for ``dotted`` "a.b...", creating missing sections.

    Raises:
        ConfigError: a key on the way holds a value, not a section.
    """
    keys = dotted.split(".")
    node = raw
    for i, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {'.'.join(keys[:i + 1])} is not a section")
        node = child
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.lr=3e-4"`` -> ``("train.lr", 3e-4)`` (the value is parsed as YAML).

    Raises:
        ConfigError: no ``=`` or an empty key.
    """
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects section.field=value, got {text!r}")
    return key.strip(), yaml.safe_load(value) if value.strip() else None


def format_validation_error(err: ValidationError, source: str) -> str:
    """Every problem of a pydantic validation error as "  dotted.field: message (got value)"
    lines under a header naming ``source``."""
    lines = [f"invalid config {source}: {err.error_count()} problem(s)"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {loc}: unknown key")
        else:
            lines.append(f"  {loc}: {e['msg']} (got {json.dumps(e.get('input'), default=str)[:80]})")
    return "\n".join(lines)
