"""The decode attention kernel: every decode and verify row of a pass attends its own slot of the
KV pool in one call (``serve/engine/csrc/decode_attention.cpp``), built on first use.

Why a kernel: on a CPU, attention over the pool took a third of a generation step. PyTorch offers
either one SDPA call per request (its dispatch costs about as much as the arithmetic at a few
hundred positions) or one batched product padded to the longest row and over the holes finished
requests leave (``serve.engine.kv_pool.SingleTokenRows``). The kernel reads each row's own
positions in place, in parallel over (row, key/value head), with fp32 scores, softmax and sums,
like SDPA's CPU kernel. Measured on 2 cores (128 rows, 100-900 positions, 3 KV heads of 64, bf16,
one layer): ~1.6 ms against ~12 ms for the per-request SDPA calls.

Inner paths per instruction set (the C++ file's header): AVX-512-BF16 dot products for bf16, and
otherwise loops the compiler vectorises for the CPU's instruction sets: on an AVX2-only CPU, fp32
(its ``dtype: auto``) runs them built for AVX2 + FMA, measured up to 1.7x the baseline x86-64
build and faster than hand-written AVX2 intrinsics (``benchmarks/results/decode_kernel_paths/2026-12-04_avx512-bf16.md``).

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

from serve.engine.build_lock import exclusive_build

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
    flags = platform.machine() + _cpu_flags_line()
    return hashlib.sha1(f"{flags} {torch.__version__}".encode()).hexdigest()[:12]


X86_64 = platform.machine() in ("x86_64", "AMD64")
# instruction-set targets of a build: the engine's (this CPU's every instruction set) and two
# fixed ones, so that each inner path of the kernel can be built and tested on a machine that has
# more (benchmarks/decode_kernel_paths.py, tests/unit/test_decode_attention.py)
ISA_FLAGS = {"native": ["-march=native"],
             "avx2": ["-march=x86-64-v3"],  # AVX2 + FMA, no AVX-512: an AVX2-only CPU's build
             "portable": ["-march=x86-64"] if X86_64 else []}


def isa_supported(isa: str) -> bool:
    """Whether this CPU runs a build for ``isa`` (a key of :data:`ISA_FLAGS`): native and
    portable always; avx2 where the CPU reports avx2 and fma (x86-64 only)."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"unknown instruction-set target {isa!r}: one of {sorted(ISA_FLAGS)}")
    if isa != "avx2":
        return True
    if not X86_64:
        return False
    flags = _cpu_flags()
    return {"avx2", "fma"} <= flags


def expected_paths(isa: str | None = None) -> dict[str, str]:
    """The inner paths a build for ``isa`` (as :func:`decode_kernel`) would report, from this
    CPU's flags, without building it: the C++ file's rule (its ``kernel_paths``)."""
    isa = engine_isa(isa)
    flags = _cpu_flags()
    native = isa == "native"
    if (native and "avx512f" in flags):
        loops = "vectorised loops, AVX-512"
    elif isa == "avx2" or (native and {"avx2", "fma"} <= flags):
        loops = "vectorised loops, AVX2+FMA"
    elif X86_64:
        loops = "vectorised loops, baseline x86-64 (SSE2)"
    else:
        loops = "vectorised loops, this architecture's baseline"
    bf16 = (f"avx512_bf16 dot products (head dim 64; {loops} otherwise)"
            if native and "avx512_bf16" in flags else loops)
    return {"float32": loops, "bfloat16": bf16}


def _cpu_flags() -> set[str]:
    """The CPU's instruction-set flags as /proc/cpuinfo lists them (empty where it does not)."""
    return set(_cpu_flags_line().split(":", 1)[-1].split())


def _cpu_flags_line() -> str:
    """/proc/cpuinfo's first flags line ("flags : fpu ... avx2 ..."), "" where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def build_directory(isa: str | None = None) -> Path:
    """Where the kernel for this machine (and instruction-set target ``isa``, as
    :func:`decode_kernel`) is built and cached."""
    isa = engine_isa(isa)
    root = os.environ.get("TORCH_EXTENSIONS_DIR",
                          str(Path.home() / ".cache" / "dspark_ray" / "torch_extensions"))
    suffix = "" if isa == "native" else f"_{isa}"
    return Path(root) / f"dspark_decode_attention_{_cpu_key()}{suffix}"


@functools.lru_cache(maxsize=None)
def _module(isa: str):
    """The compiled extension module for ``isa``, or None where it cannot be built (a warning
    says why, once per process and target).

    Raises:
        ValueError: a target this CPU cannot run (:func:`isa_supported`; an explicit argument).
    """
    from torch.utils.cpp_extension import load

    if not isa_supported(isa):
        raise ValueError(f"this CPU cannot run a build for {isa!r}")
    directory = build_directory(isa)
    # torch builds with ninja: the one pip installs beside this interpreter counts even when the
    # environment is not activated (install.sh calls .venv/bin/python directly)
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    suffix = "" if isa == "native" else f"_{isa}"
    try:
        # torch's own lock file outlives a process killed while loading: exclusive_build clears one
        with exclusive_build(directory):
            return load(name=f"dspark_decode_attention{suffix}", sources=[str(SOURCE)],
                        build_directory=str(directory),
                        # -ffast-math for the compile only (vectorised sums and exp); not at the
                        # link, where it would set flush-to-zero for the whole process
                        extra_cflags=["-O3", *ISA_FLAGS[isa], "-ffast-math", "-fopenmp"],
                        extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, headers or disk: PyTorch attention instead
        logger.warning("decode attention kernel not built (%s: %s); the engine attends with "
                       "PyTorch alone (same results, slower)", type(exc).__name__, exc)
        return None


def decode_kernel(isa: str | None = None):
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

    Args:
        isa: the instruction-set target of the build (:data:`ISA_FLAGS`); None = the
            environment's ``DSPARK_DECODE_KERNEL_ISA``, else "native" (this CPU's, so its fastest
            paths), which the engine uses. The others exist to build, test and measure each path
            on a CPU that has more (e.g. an AVX2-only machine's, reproduced on an AVX-512 one
            with torch's ``ATEN_CPU_CAPABILITY=avx2``).
    Raises:
        ValueError: an unknown target, or one this CPU cannot run (:func:`isa_supported`).
    """
    module = _module(engine_isa(isa))
    return None if module is None else module.decode_attention


def engine_isa(isa: str | None = None) -> str:
    """``isa``, else the environment's ``DSPARK_DECODE_KERNEL_ISA``, else "native": the build the
    engine uses. An environment value that is unknown or that this CPU cannot run is warned about
    (once) and replaced by "native"."""
    if isa:
        return isa
    wanted = os.environ.get("DSPARK_DECODE_KERNEL_ISA", "native")
    if wanted in ISA_FLAGS and isa_supported(wanted):
        return wanted
    _warn_isa_once(wanted)
    return "native"


@functools.lru_cache(maxsize=None)
def _warn_isa_once(wanted: str) -> None:
    logger.warning("DSPARK_DECODE_KERNEL_ISA=%r is not a build this CPU can run (%s): using "
                   "the native build", wanted, sorted(ISA_FLAGS))


def forget_kernels() -> None:
    """Forget the builds this process loaded (and any failure to build), so that the next call
    builds or loads again (a test that removes the compiler, then restores it)."""
    _module.cache_clear()


def kernel_paths(isa: str | None = None) -> dict[str, str] | None:
    """The inner path a build takes per dtype ({"float32": ..., "bfloat16": ...}: "avx512_bf16
    dot products ..." or "vectorised loops, <instruction sets>"), as it was compiled; None where
    it cannot be built. ``isa``: as :func:`decode_kernel`."""
    module = _module(engine_isa(isa))
    return None if module is None else dict(module.kernel_paths())
