"""Where relative paths in configs point: the project root.

Relative local paths (in pipeline and serve configs alike) resolve against the checkout dspark-ray
was installed from (so ``ray job submit --working-dir .``, ``serve run`` and a local run see the
same files), or ``$DSPARK_PROJECT_ROOT``, or the current directory. URLs (``s3://...``) pass
through unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from urllib.parse import urlparse

import fsspec


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


def local_copy(path: str, storage_options: dict | None = None) -> str:
    """A local directory holding ``path``: the path itself (resolved) when it is local, else a
    fresh download of the remote directory (``s3://bucket/prefix``) into this machine's cache.

    Stages and replicas run on whichever node Ray picks, so a drafter published to shared storage
    is fetched where it is used rather than read from the head's disk. Each call downloads again
    (a re-trained drafter under the same URL is never served stale); the copy is complete before
    it is visible (downloaded beside, then renamed).

    Args:
        path: a local directory or a URL fsspec can list (``s3://``; s3fs options below).
        storage_options: s3fs options (endpoint_url, key, secret, ...).
    Returns:
        A local directory path (str).
    Raises:
        FileNotFoundError: nothing exists at the URL (named).
    """
    if not is_url(path):
        return resolve(path)

    fs, _, (root,) = fsspec.get_fs_token_paths(path, storage_options=storage_options or {})
    files = [f for f in fs.find(root) if not f.endswith("/")]
    if not files:
        raise FileNotFoundError(f"{path}: no files there (was the stage that writes it run?)")
    cache = Path("~/.cache/dspark_ray/remote").expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    # one copy per URL and process: replicas on one node never swap each other's files
    dest = cache / f"{hashlib.sha256(path.rstrip('/').encode()).hexdigest()[:16]}-{os.getpid()}"
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=dest.name + "."))
    for f in files:
        local = tmp / f[len(root.rstrip("/")) + 1:]
        local.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(f, str(local))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return str(dest)
