"""A lock around torch's just-in-time C++ builds that a killed process cannot leave behind.

``torch.utils.cpp_extension.load`` (which builds the decode attention kernel and DeepSpeed's CPU
communication op) guards each build directory with a lock *file* (``<dir>/lock``, torch's
``FileBaton``) that only the process holding it removes, and every later load waits for that file
to go, without end. A process killed while it held it (a training worker stopped by a fault or a
test, Ctrl-C on a benchmark) leaves the file behind, and every later run on the machine hangs in
its first load (measured: a training run stopped during DeepSpeed's op load at 05:01 left
``deepspeed_shm_comm/lock``; the next CI run's training tests waited until its 90 minutes ran out).

:func:`exclusive_build` holds an ``flock`` on ``<dir>/build.flock`` around torch's load. The
kernel releases an flock when its holder dies, so while it is held no live process of ours is
building in that directory, and a lock file found there is one a dead process left: it is removed
(with a warning naming it) before torch looks for it.
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
def exclusive_build(directory: Path | str, timeout_s: float = 1800.0,
                    poll_s: float = 0.2) -> Iterator[None]:
    """Hold the build lock of ``directory`` (created if missing) for the ``with`` block, after
    removing a torch lock file a dead process left there.

    Args:
        directory: the extension's build directory (where torch writes ``lock``).
        timeout_s: seconds to wait for another live process's build (a build takes ~30-60 s on
            2 cores, several times that on a loaded machine).
        poll_s: seconds between tries while another process holds the lock.
    Raises:
        TimeoutError: another process held the lock for ``timeout_s`` (the message names the
            directory).
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
            stale = directory / TORCH_LOCK_FILE
            if stale.exists():
                logger.warning("removing %s: a build lock left by a process that ended while "
                               "it built or loaded there (torch would wait for it forever)",
                               stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
