"""Filesystems: local paths and ``s3://`` URLs (through s3fs, wrapped for pyarrow).

Relative local paths in configs resolve against the project root (``serve.paths``, re-exported
here as ``storage.resolve`` for the pipeline's stages).
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.fs as pafs

from serve.paths import is_url, project_root, resolve  # noqa: F401  (the pipeline's path API)


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts]) if is_url(base) else str(Path(base, *parts))


def get_fsspec(path: str, storage_options: dict | None = None):
    """An fsspec filesystem for ``path`` (s3fs for s3://, local otherwise)."""
    import fsspec

    if path.startswith("s3://"):
        import s3fs

        return s3fs.S3FileSystem(**(storage_options or {}))
    return fsspec.filesystem("file")


def get_arrow_fs(path: str, storage_options: dict | None = None):
    """(pyarrow filesystem, path inside it) for reading/writing Parquet at ``path``.

    For s3:// the s3fs files are opened without s3fs's read-ahead cache (unless the storage
    options choose one): pyarrow asks for exactly the byte ranges it needs and coalesces them
    itself, and a read-ahead would fetch up to a block (50 MB) more per request.
    """
    if path.startswith("s3://"):
        options = {"default_cache_type": "none", **(storage_options or {})}
        fs = pafs.PyFileSystem(pafs.FSSpecHandler(get_fsspec(path, options)))
        return fs, path[len("s3://"):]
    return pafs.LocalFileSystem(), path


def check_writable(path: str, storage_options: dict | None = None) -> None:
    """Fail fast on an unreachable bucket or an unwritable directory.

    Raises:
        ConnectionError / PermissionError naming ``path``.
    """
    if path.startswith("s3://"):
        fs = get_fsspec(path, storage_options)
        bucket = path[len("s3://"):].split("/", 1)[0]
        try:
            fs.ls(bucket, refresh=True)
        except Exception as err:  # s3fs raises many types (auth, DNS, no bucket)
            raise ConnectionError(f"cannot reach {path} (bucket {bucket!r}): "
                                  f"{type(err).__name__}: {err}") from err
        return
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PermissionError(f"cannot create output directory {path}: {err}") from err


def write_bytes_atomic(path: str, data: bytes, storage_options: dict | None = None) -> None:
    """Write a whole object so readers never see a partial one: local files go through a temporary
    name and ``os.replace``; an S3 object becomes visible only when its upload completes.

    Raises:
        OSError: the write failed (a full disk; an upload whose retries are spent, the object
            named); nothing is left at ``path`` or in a temporary.
    """
    if is_url(path):
        fs = get_fsspec(path, storage_options)
        try:
            with fs.open(path, "wb") as fh:
                fh.write(data)
        except OSError as err:  # s3fs's message alone ("Please reduce your request rate") names
            # neither the object nor that the retries are spent
            raise OSError(err.errno, f"upload of {path} failed after the store's retries: "
                                     f"{err.strerror or err}") from err
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:  # e.g. a full disk: no partial file and no temporary left behind
        tmp.unlink(missing_ok=True)
        raise


def read_bytes(path: str, storage_options: dict | None = None) -> bytes:
    fs = get_fsspec(path, storage_options)
    with fs.open(path, "rb") as fh:
        return fh.read()


def exists(path: str, storage_options: dict | None = None) -> bool:
    return get_fsspec(path, storage_options).exists(path)


def list_files(directory: str, suffix: str, storage_options: dict | None = None) -> list[str]:
    """Sorted full paths (URLs for s3) of files in ``directory`` ending with ``suffix``."""
    fs = get_fsspec(directory, storage_options)
    if not fs.exists(directory):
        return []
    names = [p for p in fs.ls(directory, detail=False) if p.endswith(suffix)]
    if directory.startswith("s3://"):
        names = ["s3://" + n if not n.startswith("s3://") else n for n in names]
    return sorted(names)
