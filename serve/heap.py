"""Returning the allocator's free memory to the operating system (glibc only).

A serving process allocates large short-lived tensors from several threads (the engine, torch's
intra-op pool, Ray Serve's and asyncio's threads). glibc keeps what they free inside its
per-thread heap arenas, so resident memory climbs to the high-water mark of every arena and
stays there, although the memory is free (measured: `benchmarks/results/serve_soak/2026-12-01_unrecorded.md`, new
64 MB arenas filling during a soak while the KV pool never grew). ``malloc_trim(0)`` hands the
free pages of every arena back (``madvise(MADV_DONTNEED)``); the engine thread calls it every
few seconds between steps.
"""

from __future__ import annotations

import ctypes
import logging
import time

logger = logging.getLogger(__name__)


class HeapTrimmer:
    """Calls glibc's ``malloc_trim(0)`` at most once per ``interval_s`` seconds.

    Args:
        interval_s: seconds between trims; 0 disables trimming.
    Elsewhere than glibc (musl, macOS) :meth:`maybe_trim` does nothing.
    """

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._trim = None
        self._dirty = False  # steps ran since the last trim
        self.trims = 0  # trims done (tests, logs)
        if interval_s > 0:
            try:  # the soname directly: find_library would spawn ldconfig at replica start
                self._trim = ctypes.CDLL("libc.so.6").malloc_trim
                self._trim.argtypes, self._trim.restype = [ctypes.c_size_t], ctypes.c_int
            except (OSError, AttributeError):
                logger.info("no glibc malloc_trim here: the heap is not trimmed")
        self._last = time.monotonic()

    def maybe_trim(self, idle: bool = False) -> None:
        """After a step (``idle`` False): trim when ``interval_s`` has passed since the last trim.
        Before the engine waits for work (``idle`` True): trim if any step ran since the last
        trim, so an idle replica does not sit at its last burst's high-water mark."""
        if self._trim is None:
            return
        if not idle:
            self._dirty = True
        due = self._dirty if idle else time.monotonic() - self._last >= self.interval_s
        if not due:
            return
        self._trim(0)
        self.trims += 1
        self._dirty = False
        self._last = time.monotonic()
