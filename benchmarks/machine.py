"""What every benchmark records about the machine it ran on (issue 41: numbers name their
machine): the device, the CPU model, torch's capability ("AVX2", "AVX512", ...) and whether bf16
is native, cores and torch threads. One CPU model name ("AMD EPYC") covers AVX2-only and
AVX-512-BF16 generations whose bf16 speed differs ~4x, so the capability is part of every
result's meta and markdown header."""

from __future__ import annotations

import os

import torch

from drafters.precision import capability
from pipeline.doctor import cpu_model


def machine() -> dict:
    """The machine as JSON fields: device, cpu_model, cpu_capability, native_bf16, cores,
    torch_threads, torch."""
    cap = capability("cpu")
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "cpu_model": cpu_model(), "cpu_capability": cap.name,
            "native_bf16": cap.native_bf16, "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__}


def describe(m: dict | None = None) -> str:
    """One line for a markdown header, e.g. "AMD EPYC, AVX512 with native bf16, 2 cores
    (2 torch threads), no GPU"."""
    m = m or machine()
    bf16 = "native bf16" if m["native_bf16"] else "no native bf16"
    gpu = "no GPU" if m["device"] == "cpu" else m["device"]
    return (f"{m['cpu_model']}, {m['cpu_capability']} with {bf16}, {m['cores']} cores "
            f"({m['torch_threads']} torch threads), {gpu}")
