"""The decode attention kernel: every decode and verify row of a pass attends its own slot of the
KV pool in one call (``serve/engine/csrc/decode_attention.cpp``), built on first use.

Why a kernel: on a CPU, attention over the pool took a third of a generation step. PyTorch offers
either one SDPA call per request (its dispatch costs about as much as the arithmetic at a few
hundred positions) or one batched product padded to the longest row and over the holes finished
requests leave (``serve.engine.kv_pool.SingleTokenRows``). The kernel reads each row's own
positions in place, in parallel over (row, key/value head), with fp32 scores, softmax and sums,
like SDPA's CPU kernel. Measured on 2 cores (128 rows, 100-900 positions, 3 KV heads of 64, bf16,
one layer): ~1.6 ms against ~12 ms for the per-request SDPA calls.

The build (~30 s, once per machine) is compiled for the CPU it runs on (``-march=native``) and
kept under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/dspark_ray/torch_extensions``, the
directory DeepSpeed's op uses too) in a directory named after the CPU's instruction sets and the
torch version, so nodes of a cluster that share a home directory never load each other's builds.
Where it cannot be built (no C++ compiler), :func:`decode_kernel` says so once and returns None;
the engine then attends with PyTorch alone (same results, slower).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "decode_attention.cpp"
# Rows of a request attended by the kernel at most (decode: 1, verify: a draft block + 1); a
# longer run of new tokens (a prompt chunk) goes to SDPA, which computes it as one matrix product
# where the kernel would read the request's keys once per query.
MAX_KERNEL_QUERIES = 32
# Query heads per key/value head the kernel handles (its compiled cases, checked there too).
MAX_QUERY_GROUPS = 8


def _cpu_key() -> str:
    """Identifies what the build depends on: the CPU's instruction sets and torch's version."""
    flags = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags += line
                break
    except OSError:
        pass
    return hashlib.sha1(f"{flags} {torch.__version__}".encode()).hexdigest()[:12]


def build_directory() -> Path:
    """Where the kernel for this machine is built and cached."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR",
                          str(Path.home() / ".cache" / "dspark_ray" / "torch_extensions"))
    return Path(root) / f"dspark_decode_attention_{_cpu_key()}"


@functools.lru_cache(maxsize=None)
def decode_kernel():
    """The compiled ``decode_attention(q, keys, values, slots, lengths, scale, starts=None,
    sinks=None)`` function, or None where it cannot be built (a warning says why, once per
    process).

    The function: ``q`` float32/bfloat16 ``[N, Hq, d]`` contiguous; ``keys``, ``values`` one
    layer's pool ``[slots, Hkv, capacity, d]`` of the same dtype; ``slots``, ``lengths`` int64
    ``[N]``: row r attends positions ``[starts[r], lengths[r])`` of slot ``slots[r]``
    (``starts`` int64 ``[N]``, a sliding window's first key; None: 0); ``sinks`` float32
    ``[Hq]``, one attention-sink logit per query head joining the softmax's denominator (None:
    none); ``scale`` the softmax scale. Returns ``[N, Hq, d]`` in q's dtype. Raises RuntimeError
    on shapes, dtypes, a slot outside the pool, a length outside ``[1, capacity]`` or a start
    outside ``[0, length)``.
    """
    from torch.utils.cpp_extension import load

    directory = build_directory()
    # torch builds with ninja: the one pip installs beside this interpreter counts even when the
    # environment is not activated (install.sh calls .venv/bin/python directly)
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        module = load(name="dspark_decode_attention", sources=[str(SOURCE)],
                      build_directory=str(directory),
                      # -ffast-math for the compile only (vectorised sums and exp); not at the
                      # link, where it would set flush-to-zero for the whole process
                      extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                      extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, headers or disk: PyTorch attention instead
        logger.warning("decode attention kernel not built (%s: %s); the engine attends with "
                       "PyTorch alone (same results, slower)", type(exc).__name__, exc)
        return None
    return module.decode_attention
