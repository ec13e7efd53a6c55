"""What every benchmark records about the machine it ran on (issue 41: numbers name their
machine): the device, the CPU model, torch's capability ("AVX2", "AVX512", ...) and whether bf16
is native, cores and torch threads. One CPU model name ("AMD EPYC") covers AVX2-only and
AVX-512-BF16 generations whose bf16 speed differs ~4x, so the capability is part of every
result's meta and markdown header."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import torch

from benchmarks.results_index import RESULTS
from drafters.precision import capability
from pipeline.doctor import cpu_model

OUT_HELP = ("the output files' path without a suffix (default: benchmarks/results/<script>/"
            "<date>_<machine class>, see result_stem)")


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


def machine_class(m: dict | None = None) -> str:
    """The machine class a result's file name carries: a GPU's name ("nvidia-h100-80gb-hbm3"),
    else torch's CPU capability, with "-bf16" where bf16 matmuls are native ("avx512-bf16",
    "avx2"): the classes whose speeds differ (issue 41)."""
    m = m or machine()
    if m["device"] != "cpu":
        return re.sub(r"[^a-z0-9]+", "-", m["device"].lower()).strip("-")
    cap = m["cpu_capability"].lower()
    return f"{cap}-bf16" if m["native_bf16"] and "bf16" not in cap else cap


def result_stem(script: str, label: str = "", m: dict | None = None, make: bool = True) -> Path:
    """Where a benchmark run's files go (issue 44.6): ``benchmarks/results/<script>/<date>_<machine
    class>[_<label>]``, the markdown at ``.md``, the JSON at ``.json``, plots at ``_<plot>.png``.
    One folder per benchmark; runs on other days or machine classes never overwrite each other.
    The folder is created unless ``make`` is false (a check of the label before any work).

    Args:
        script: the benchmark's file name without ``.py`` ("serve_load").
        label: what sets this run apart ("reference_first_slot"); "" for none. Letters, digits,
            '-' and '_' only (it is part of a file name, before the suffix).
    Raises:
        ValueError: a label with other characters.
    """
    label = label.strip("_")
    if label and not re.fullmatch(r"[A-Za-z0-9_-]+", label):
        raise ValueError(f"result label {label!r}: letters, digits, '-' and '_' only")
    folder = RESULTS / script
    if make:
        folder.mkdir(parents=True, exist_ok=True)
    name = f"{time.strftime('%Y-%m-%d')}_{machine_class(m)}" + (f"_{label}" if label else "")
    return folder / name


def latest_stem(script: str, label: str = "", m: dict | None = None) -> Path | None:
    """The newest earlier run of ``script`` on this machine class with this label (its files'
    path without a suffix, a ``.json`` beside it), or None: what a run that adds to an earlier one
    (``fault_matrix --merge``) continues when no ``--out`` names it."""
    label = label.strip("_")
    tail = f"_{machine_class(m)}" + (f"_{label}" if label else "")
    found = sorted(p for p in (RESULTS / script).glob(f"20??-??-??{tail}.json")
                   if re.fullmatch(r"20\d\d-\d\d-\d\d" + re.escape(tail), p.stem))
    return found[-1].with_suffix("") if found else None
