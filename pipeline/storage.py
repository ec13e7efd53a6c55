"""Filesystems: local paths and ``s3://`` URLs (through s3fs, wrapped for pyarrow).

Relative local paths in configs resolve against the project root (``serve.engine.paths``,
re-exported here as ``storage.resolve`` for the pipeline's stages).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import time
from pathlib import Path

import fsspec
import pyarrow.fs as pafs

from serve.engine.paths import is_url, local_copy, project_root, resolve  # noqa: F401  (the pipeline's path API)

logger = logging.getLogger(__name__)


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts]) if is_url(base) else str(Path(base, *parts))


def get_fsspec(path: str, storage_options: dict | None = None):
    """An fsspec filesystem for ``path`` (s3fs for s3://, local otherwise)."""
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


class AtomicWriter:
    """A binary file, written sequentially, that appears at ``path`` only when committed, so a
    reader never sees part of it: a local file is written under a temporary name in the same
    directory (``.<name>.tmp-<pid>``), fsync'ed and renamed on commit; an S3 object is streamed
    as a multipart upload (parts of ``block_size_bytes`` go out while writing) that S3 makes
    visible only when the upload completes on commit, and a discarded upload is aborted.

    Use as a context manager (commit on success, discard on an exception) or call
    :meth:`commit` / :meth:`discard`. Keeps the sha256 and the length of what was written.
    Transient S3 errors are retried per request by s3fs/botocore with backoff; see
    :func:`retry_transient` for retrying a whole write. (Hashing and uploading from a background
    thread was tried and measured no faster in ``benchmarks/cache_io.py``.)

    Args:
        path: local path or s3:// URL.
        block_size_bytes: S3 part size (at least 5 MiB; the s3fs option ``default_block_size``,
            50 MiB unless set, when None).
    Raises:
        OSError: from ``write``/``commit``: the write failed (a full disk; an upload whose
            retries are spent, the object named); nothing is left at ``path``.
    """

    def __init__(self, path: str, storage_options: dict | None = None,
                 block_size_bytes: int | None = None):
        self.path, self.sha256, self.bytes_written = path, hashlib.sha256(), 0
        self.closed = False
        if is_url(path):
            fs = get_fsspec(path, storage_options)
            kwargs = {"block_size": block_size_bytes} if block_size_bytes else {}
            self._tmp = None
            self._fh = self._guard(lambda: fs.open(path, "wb", **kwargs))
        else:
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            self._tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
            self._fh = open(self._tmp, "wb")

    def _guard(self, fn):
        """Run a store call; name the object in an S3 failure (s3fs's message alone, e.g.
        "Please reduce your request rate", names neither it nor that the retries are spent)."""
        if self._tmp is not None:
            return fn()
        try:
            return fn()
        except OSError as err:
            raise OSError(err.errno, f"upload of {self.path} failed after the store's retries: "
                                     f"{err.strerror or err}") from err

    def write(self, data) -> int:
        self._guard(lambda: self._fh.write(data))
        self.sha256.update(data)
        self.bytes_written += len(data)
        return len(data)

    def tell(self) -> int:
        return self.bytes_written

    def flush(self) -> None:  # S3 parts go out as they fill; the file is fsync'ed on commit
        pass

    def writable(self) -> bool:
        return True

    def commit(self) -> None:
        """Make the file visible at ``path`` (complete the upload / fsync and rename).

        Raises:
            OSError: as the class says; the file is discarded first.
        """
        try:
            if self._tmp is None:
                self._guard(self._fh.close)
            else:
                self._fh.flush()
                os.fsync(self._fh.fileno())
                self._fh.close()
                os.replace(self._tmp, self.path)
        except BaseException:
            self.discard()
            raise
        self.closed = True

    def discard(self) -> None:
        """Drop what was written: no object or file at ``path`` and no temporary left (an S3
        multipart upload is aborted; if even that fails, S3 keeps the parts out of sight)."""
        if self.closed:
            return
        self.closed = True
        if self._tmp is None:
            try:
                self._fh.discard()  # aborts the multipart upload, if one was started
            except Exception as err:  # the store may be the reason we are here
                logger.warning("could not abort the upload of %s: %s", self.path, err)
            self._fh.closed = True  # so that closing it can never complete the upload
        else:
            self._fh.close()
            self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "AtomicWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()


def write_bytes_atomic(path: str, data: bytes, storage_options: dict | None = None) -> None:
    """Write a whole object so readers never see a partial one (see :class:`AtomicWriter`).

    Raises:
        OSError: the write failed (a full disk; an upload whose retries are spent, the object
            named); nothing is left at ``path`` or in a temporary.
    """
    with AtomicWriter(path, storage_options) as fh:
        fh.write(data)


def is_transient(err: BaseException) -> bool:
    """Whether a storage error may pass on its own (throttling, 5xx, a dropped connection), as
    opposed to a missing bucket or key, a denied request or a full disk."""
    if isinstance(err, (FileNotFoundError, PermissionError, IsADirectoryError,
                        NotADirectoryError)):
        return False
    return isinstance(err, (OSError, TimeoutError)) and getattr(err, "errno", None) != errno.ENOSPC


def retry_transient(fn, *, what: str, attempts: int = 4, base_delay_s: float = 2.0,
                    sleep=time.sleep):
    """Call ``fn()``; when it raises a transient storage error (:func:`is_transient`) after the
    store client's own retries, wait ``base_delay_s * 2**k`` and call it again, ``attempts``
    calls in all. ``fn`` must be safe to repeat (e.g. rewrite a whole shard).

    Raises:
        The last error, when it is not transient or the attempts are spent.
    """
    for k in range(attempts):
        try:
            return fn()
        except Exception as err:
            if k == attempts - 1 or not is_transient(err):
                raise
            delay = base_delay_s * 2 ** k
            logger.warning("%s: %s: %s; retrying in %.0f s (attempt %d of %d)", what,
                           type(err).__name__, err, delay, k + 2, attempts)
            sleep(delay)


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


def upload_dir(local: str | Path, dest: str, storage_options: dict | None = None) -> None:
    """Replace directory ``dest`` (local path or s3:// URL) with a copy of ``local``.

    What was at ``dest`` is removed first, so no file of an older copy survives beside the new
    one; readers fetch ``dest`` only after the stage that publishes it has finished.
    """
    fs = get_fsspec(dest, storage_options)
    if fs.exists(dest):
        fs.rm(dest, recursive=True)
    for file in sorted(Path(local).rglob("*")):
        if file.is_file():
            target = join(dest, *file.relative_to(local).parts)
            if not is_url(dest):
                Path(target).parent.mkdir(parents=True, exist_ok=True)
            fs.put_file(str(file), target)
