"""Which precision this machine computes fastest: ``dtype: auto`` resolved once per process.

bf16 halves memory traffic and is the fast path where the hardware multiplies bf16 natively: CUDA
GPUs that support it, and CPUs with AVX-512-BF16 or AMX. Elsewhere (an AVX2-only CPU: most laptops
and many cloud instances) PyTorch emulates bf16 matmuls, and they are far slower than fp32:
measured on a 2-core AMD EPYC with AVX2 only, a ``[256 x 576] @ [576 x 1536]`` bf16 matmul ran at
~1 GFLOP/s against ~124 in fp32, and the SmolLM2-135M forward on 32 x 64 tokens 4.3x slower
(issue 41). So ``auto`` means bf16 where it is native and fp32 otherwise, decided from torch's own
capability checks (``torch.cuda.is_bf16_supported``, ``torch.cpu._is_avx512_bf16_supported``,
``torch.cpu._is_amx_tile_supported``), logged once per process with the reason. An explicit dtype
always wins; a half-precision one on a CPU without native support logs a warning naming the
expected slowdown.

Where it is resolved: in the process that computes (a Ray worker on a GPU node sees its GPU), by
:func:`resolve_dtype` inside the loaders (``drafters.target_weights.load_target``, the serving
builder) and by :func:`train_precision` in the training worker. What is stored is a format, not a
speed: the target cache is bf16 on disk whatever the compute dtype (``pipeline/cache/format.py``).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

AUTO = "auto"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = (AUTO, *DTYPES)
# the measured cost of emulated bf16 on an AVX2-only CPU (module docstring)
EMULATED_SLOWDOWN = "~4x slower than float32 (bf16 is emulated; measured 4.3x on SmolLM2)"


@dataclass(frozen=True)
class Capability:
    """What a device computes natively.

    Fields: device: "cuda" or "cpu"; name: the GPU's name or torch's CPU capability ("AVX2",
    "AVX512", ...); native_bf16 / native_fp16: whether bf16 / fp16 matmuls run natively;
    reason: one line saying why (for logs and ``pipeline.doctor``).
    """

    device: str
    name: str
    native_bf16: bool
    native_fp16: bool
    reason: str


def _cpu_check(name: str) -> bool:
    check = getattr(torch.cpu, name, None)  # private helpers: absent in another torch is "no"
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False


def capability(device: str | torch.device | None = None, probe: bool = True) -> Capability:
    """What ``device`` (default: CUDA when this process sees a GPU, else the CPU) computes
    natively, from torch's own checks (once per process and device type). A CUDA device this
    process cannot see (a driver planning for GPU workers) is assumed to have bf16 (every GPU
    since Ampere)."""
    kind = torch.device(device).type if device is not None else (
        "cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not probe:  # a driver planning for GPU workers: no CUDA context here
        return UNPROBED_GPU
    return _capability(kind)


@functools.lru_cache(maxsize=None)
def _capability(kind: str) -> Capability:
    if kind == "cuda":
        if not torch.cuda.is_available():
            return UNPROBED_GPU
        name = torch.cuda.get_device_name()
        # native only: by default torch also says yes where bf16 is emulated (compute < 8.0,
        # V100 / T4), where it is slow and vLLM refuses it
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        return Capability("cuda", name, bf16, True,
                          f"{name}: bf16 {'supported' if bf16 else 'not supported'}")
    if kind != "cpu":
        return Capability(kind, kind, False, False, f"{kind}: no native-precision check, fp32")
    cap = torch.backends.cpu.get_cpu_capability()
    avx512_bf16 = _cpu_check("_is_avx512_bf16_supported")
    amx = _cpu_check("_is_amx_tile_supported")
    amx_fp16 = _cpu_check("_is_amx_fp16_supported")
    found = [f for f, on in (("avx512_bf16", avx512_bf16), ("amx", amx)) if on]
    # torch told to dispatch narrower kernels (ATEN_CPU_CAPABILITY=avx2, e.g. to reproduce an
    # AVX2-only machine) is taken at its word: that machine has no native bf16
    narrowed = bool(found) and not cap.startswith(("AVX512", "AMX"))
    bf16 = bool(found) and not narrowed
    if bf16:
        reason = f"CPU {cap} with {' and '.join(found)}: native bf16 matmuls"
    elif narrowed:
        told = os.environ.get("ATEN_CPU_CAPABILITY")
        reason = (f"CPU with {' and '.join(found)}, but torch dispatches {cap} kernels here"
                  + (f" (ATEN_CPU_CAPABILITY={told})" if told else "")
                  + ": treated as a CPU without native bf16")
    else:
        reason = f"CPU {cap} without avx512_bf16 or amx: bf16 matmuls are emulated"
    return Capability("cpu", cap, bf16, amx_fp16, reason)


UNPROBED_GPU = Capability("cuda", "unprobed GPU", True, True,
                          "a GPU this process does not probe (planning for GPU workers): bf16 "
                          "assumed (Ampere and later)")
_logged: set[tuple[str, str]] = set()


def resolve_dtype(name: str, device: str | torch.device | None = None,
                  cap: Capability | None = None) -> torch.dtype:
    """The torch dtype of a config's dtype setting on this process's device.

    Args:
        name: "auto", "float32", "bfloat16" or "float16".
        device: where the computation runs (default: CUDA when visible, else CPU).
        cap: the device's :class:`Capability` (tests inject one; default: measured).
    Returns:
        ``auto``: bfloat16 where it is native, else float32; otherwise the named dtype.
    Raises:
        ValueError: an unknown name (the message lists the choices).
    """
    if name not in DTYPE_CHOICES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {list(DTYPE_CHOICES)}")
    cap = cap or capability(device)
    if name == AUTO:
        chosen = "bfloat16" if cap.native_bf16 else "float32"
        _log_once((name, cap.device), logging.INFO, "dtype auto -> %s (%s)", chosen, cap.reason)
        return DTYPES[chosen]
    native = {"bfloat16": cap.native_bf16, "float16": cap.native_fp16}.get(name, True)
    if not native and cap.device == "cpu":
        _log_once((name, cap.device), logging.WARNING,
                  "dtype %s requested on a CPU without native %s (%s): expect it %s; dtype auto "
                  "(or float32) is the fast choice here", name, name, cap.reason,
                  EMULATED_SLOWDOWN)
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" / "bfloat16" / "float16" of a torch dtype (what reports record)."""
    return str(dtype).removeprefix("torch.")


def resolve_dtype_name(name: str, device: str | torch.device | None = None,
                       cap: Capability | None = None) -> str:
    """:func:`resolve_dtype` as a name ("float32", "bfloat16", "float16")."""
    return dtype_name(resolve_dtype(name, device, cap))


def train_precision(name: str, device: str | torch.device | None = None,
                    cap: Capability | None = None, probe: bool = True) -> str:
    # (the training worker passes its device; the memory planner "cuda" or "cpu" by use_gpu,
    # with probe=False: no CUDA context in the driver)
    """The training precision of ``train.precision`` on this worker: "bf16" (autocast forward,
    fp32 master weights; DeepSpeed's bf16 autocast section on CUDA) or "fp32". ``auto`` is bf16
    where bf16 is native, by the rule of :func:`resolve_dtype`.

    Raises:
        ValueError: a name other than "auto", "bf16", "fp32".
    """
    if name not in ("auto", "bf16", "fp32"):
        raise ValueError(f"unknown training precision {name!r}; choose auto, bf16 or fp32")
    as_dtype = {"auto": AUTO, "bf16": "bfloat16", "fp32": "float32"}[name]
    cap = cap or capability(device, probe)
    return "bf16" if resolve_dtype(as_dtype, device, cap) == torch.bfloat16 else "fp32"


def _log_once(key: tuple[str, str], level: int, msg: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.log(level, msg, *args)
