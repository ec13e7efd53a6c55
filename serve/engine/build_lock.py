"""A lock around torch's just-in-time C++ builds that a killed process cannot leave behind.

``torch.utils.cpp_extension.load`` (which builds the decode attention kernel and DeepSpeed's CPU
communication op) guards each build directory with a lock *file* (``<dir>/lock``, torch's
``FileBaton``) that only the process holding it removes, and every later load waits for that file
to go, without end. A process killed while it held it (a training worker stopped by a fault or a
test, Ctrl-C on a benchmark) leaves the file behind, and every later run on the machine hangs in
its first load (measured: a training run stopped during DeepSpeed's op load at 05:01 left
``deepspeed_shm_comm/lock``; the next CI run's training tests waited until its 90 minutes ran out).

:func:`exclusive_build` holds an ``flock`` on ``<dir>/build.flock`` around torch's load. The
kernel releases an flock when its holder dies, so while it is held no live process that loads
through this module is building in that directory, and a lock file found there was left by a
dead one or belongs to a loader that does not take this lock (an older checkout sharing the
cache, DeepSpeed called directly). The latter's lock is recent, so a lock file is removed (with a
warning naming it) only once it is older than ``stale_after_s``; until then the lock is waited
for, as torch would.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import time
from pathlib import Path
from typing import Iterator

logger = logging.getLogger(__name__)

#: torch's lock file in a build directory (``torch.utils.cpp_extension._jit_compile``)
TORCH_LOCK_FILE = "lock"
#: the lock this module holds beside it
BUILD_FLOCK = "build.flock"


@contextlib.contextmanager
def exclusive_build(directory: Path | str, timeout_s: float = 1800.0, poll_s: float = 0.2,
                    stale_after_s: float = 120.0) -> Iterator[None]:
    """Hold the build lock of ``directory`` (created if missing) for the ``with`` block, after
    removing a torch lock file a dead process left there.

    Args:
        directory: the extension's build directory (where torch writes ``lock``).
        timeout_s: seconds to wait for another live process's build (a build takes ~30-60 s on
            2 cores, several times that on a loaded machine).
        poll_s: seconds between tries while another process holds the lock.
        stale_after_s: age (seconds since it was written) from which a torch lock file found
            under the lock is removed; a younger one is waited for (a loader that does not
            take this lock may be building).
    Raises:
        TimeoutError: another process held the lock, or a torch lock file stayed young, for
            ``timeout_s`` (the message names the directory).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    with open(directory / BUILD_FLOCK, "a") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another process has been building in {directory} for over "
                        f"{timeout_s:.0f} s (its lock: {directory / BUILD_FLOCK})") from None
                time.sleep(poll_s)
        try:
            _clear_stale(directory / TORCH_LOCK_FILE, deadline, poll_s, stale_after_s)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _clear_stale(lock: Path, deadline: float, poll_s: float, stale_after_s: float) -> None:
    """Wait until torch's ``lock`` is gone or older than ``stale_after_s``, then remove it.

    Raises:
        TimeoutError: it was still there and young at ``deadline`` (``time.monotonic()``).
    """
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age >= stale_after_s:
            logger.warning("removing %s (%.0f s old): a build lock left by a process that ended "
                           "while it built or loaded there (torch would wait for it forever)",
                           lock, age)
            lock.unlink(missing_ok=True)
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{lock} has been held for {age:.0f} s by a loader that does not "
                               "take the build lock")
        time.sleep(poll_s)
