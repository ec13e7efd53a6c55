"""Process helpers the benchmarks share."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_session(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """Stop a process started with ``start_new_session=True`` and everything in its session:
    SIGINT first (``serve run`` shuts Serve down on it), SIGKILL after ``timeout_s``."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
