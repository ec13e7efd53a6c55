"""Where relative paths in configs point: the project root.

Relative local paths (in pipeline and serve configs alike) resolve against the checkout dspark-ray
was installed from (so ``ray job submit --working-dir .``, ``serve run`` and a local run see the
same files), or ``$DSPARK_PROJECT_ROOT``, or the current directory. URLs (``s3://...``) pass
through unchanged.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from urllib.parse import urlparse


def is_url(path: str) -> bool:
    """Whether ``path`` is a URL (``scheme://...``) rather than a local path."""
    return "://" in path


@lru_cache(maxsize=1)
def project_root() -> Path:
    """The project checkout: $DSPARK_PROJECT_ROOT, else the editable install's source, else CWD."""
    env = os.environ.get("DSPARK_PROJECT_ROOT")
    if env:
        return Path(env)
    try:
        direct = metadata.distribution("dspark-ray").read_text("direct_url.json")
        info = json.loads(direct or "{}")
        if info.get("dir_info", {}).get("editable") and info["url"].startswith("file://"):
            return Path(urlparse(info["url"]).path)
    except metadata.PackageNotFoundError:
        pass
    return Path.cwd()


def resolve(path: str) -> str:
    """Absolute form of a config path (URLs unchanged, ``~`` expanded)."""
    if is_url(path):
        return path
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else project_root() / p)
