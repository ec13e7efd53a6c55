"""What this machine is and what dspark-ray will use on it (like ``vllm collect-env``).

    .venv/bin/python -m pipeline.doctor            # a report, with a verdict line
    .venv/bin/python -m pipeline.doctor --json     # the same as JSON
    .venv/bin/python -m pipeline.doctor --no-ray   # skip starting a local Ray (~10 s)

Reports the device (GPU name, or the CPU model and torch's capability: "AVX2", "AVX512", ...),
whether bf16 matmuls are native, cores and torch threads, what ``dtype: auto`` and
``train.precision: auto`` resolve to here (``drafters/precision.py``), the decode attention
kernel's path (built or not, bf16 fast path or portable), the bf16 and fp32 matmul rates measured
for about a second each (``[256 x 576] @ [576 x 1536]``, SmolLM2's MLP shape), Ray's resources and
the installed versions, and how long the quickstart's pipeline should take here (its fitted
work over this machine's rate at the quickstart's 2 threads: :func:`quickstart_minutes`). The
verdict names what will be slow here and why. When the project's numbers look off on your
machine, run this first: most differences are the CPU class (``benchmarks/`` results name
theirs).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import time

import torch

from drafters.precision import capability, resolve_dtype_name, train_precision
from serve.engine.decode_attention import build_directory, expected_paths, kernel_paths
from serve.engine.profiling import device_name

# the matmul timed: SmolLM2-135M's MLP up-projection on a 256-token batch
MATMUL_SHAPE = (256, 576, 1536)
# bf16 slower than fp32 by more than this: the verdict calls bf16 emulated
EMULATED_RATIO = 0.8
# The quickstart's pipeline (README's main command, install aside) as GFLOP-equivalents: its
# measured seconds x this doctor's rate of the dtype it ran in at QUICKSTART_THREADS threads, on
# 2-core runs (docs/measurements.md). The quickstart that fine-tunes the shipped drafter (session
# 42): AMD EPYC Zen 1 (AVX2 only), fp32 65 GFLOP/s x 846 s = 55 k. bf16 is that scaled by the
# bf16 / fp32 ratio of the quickstart before it (264 k / 176 k: bf16 speeds up the matmuls more
# than the rest of a step), which was measured on three machines (Xeon held to AVX2, fp32 173 x
# 1,045 s = 181 k; the Zen 1, fp32 64 x 2,670 s = 171 k; Xeon with AMX, bf16 419 x 629 s = 264 k);
# the bf16 value is unmeasured for this quickstart. A fit, not a count of operations. CPU only: a
# GPU runs this small pipeline bound by Ray's fixed costs, not by its matmuls.
QUICKSTART_WORK_GFLOP = {"float32": 55_000.0, "bfloat16": 82_500.0}
# the threads the quickstart computes with (its stages' num_threads): the rate the prediction
# reads is measured at this many, whatever the machine's core count
QUICKSTART_THREADS = 2
# minutes the install adds on a fresh machine (measured 3.9-4.1 on the Zen 1 without a pip cache,
# 1.4-1.6 on a Xeon with one)
INSTALL_ALLOWANCE_MIN = 4.0
# minutes, install included, above which the verdict warns (issue 41's bar for the slower class)
QUICKSTART_PROMISE_MIN = 20.0
PACKAGES = ("torch", "transformers", "ray", "deepspeed", "pyarrow", "pydantic", "wandb",
            "dspark-ray")


def matmul_gflops(dtype: torch.dtype, seconds: float = 1.0, device: str = "cpu") -> float:
    """GFLOP/s of repeated ``[256 x 576] @ [576 x 1536]`` products in ``dtype`` for about
    ``seconds`` (after one warm-up), on ``device``."""
    m, k, n = MATMUL_SHAPE
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=g).to(device=device, dtype=dtype)
    torch.matmul(a, b)
    count, start = 0, time.perf_counter()
    while True:
        torch.matmul(a, b)
        count += 1
        if device != "cpu":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2 * m * k * n * count / elapsed / 1e9


def quickstart_minutes(report: dict) -> float | None:
    """Predicted minutes of the quickstart's pipeline on this machine (install aside):
    ``QUICKSTART_WORK_GFLOP`` of the dtype ``dtype: auto`` resolves to / the matmul rate
    (GFLOP/s) of that dtype at ``QUICKSTART_THREADS`` threads (``report["quickstart_rate"]``,
    :func:`quickstart_rate`); None on a GPU or without a rate."""
    if report["resolved"]["device"] != "cpu":
        return None
    dtype = report["resolved"]["dtype_auto"]
    rate = report.get("quickstart_rate") or 0.0
    if dtype not in QUICKSTART_WORK_GFLOP or not rate > 0:
        return None
    return QUICKSTART_WORK_GFLOP[dtype] / rate / 60.0


def quickstart_rate(dtype: torch.dtype, seconds: float, measured: float) -> float:
    """The ``dtype`` matmul rate (GFLOP/s) at ``QUICKSTART_THREADS`` torch threads, the count
    the quickstart computes with: ``measured`` (the report's rate) where torch already runs that
    many, else measured again at that count (the thread setting is restored)."""
    threads = torch.get_num_threads()
    if threads == QUICKSTART_THREADS:
        return measured
    torch.set_num_threads(QUICKSTART_THREADS)
    try:
        return round(matmul_gflops(dtype, seconds), 1)
    finally:
        torch.set_num_threads(threads)


def cpu_model() -> str:
    """The processor's model name (the one the engine's profiles record)."""
    return device_name(torch.device("cpu"))


def kernel_state() -> dict:
    """The decode attention kernel on this machine: built (its cached build exists), buildable
    (a C++ compiler is on PATH), and the inner path per dtype (the built module's own report
    where it is built, else what this CPU's instruction sets select)."""
    directory = build_directory()
    built = any(directory.rglob("*.so")) if directory.is_dir() else False
    compiler = shutil.which("c++") or shutil.which("g++")
    paths = (kernel_paths() if built else None) or expected_paths()
    return {"built": built, "build_directory": str(directory), "compiler": compiler,
            "path": "; ".join(f"{k}: {v.split(' (')[0]}" for k, v in sorted(paths.items())),
            "paths": paths,
            "state": ("built" if built else "built on first use (~30 s)" if compiler
                      else "cannot be built (no C++ compiler): the engine attends with PyTorch")}


def ray_resources() -> dict:
    """Ray's version and resources: the cluster at ``RAY_ADDRESS`` if set, else a local Ray
    started and stopped for the question."""
    import ray

    out = {"version": ray.__version__, "address": os.environ.get("RAY_ADDRESS", "local")}
    started = not ray.is_initialized()
    try:
        if started:
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
        out["resources"] = {k: v for k, v in ray.cluster_resources().items()
                            if not k.startswith("node:")}
    except Exception as err:  # noqa: BLE001 - a doctor reports what fails
        out["error"] = f"{type(err).__name__}: {err}"
    finally:
        if started and ray.is_initialized():
            ray.shutdown()
    return out


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def gather(matmul_seconds: float = 1.0, with_ray: bool = True) -> dict:
    """The doctor's report as a dict (see the module docstring); ``verdict``: lines saying what
    will be slow here and why (empty: nothing)."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    cap = capability(device)
    cpu = capability("cpu")
    report = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "cpu": {"model": cpu_model(), "capability": cpu.name, "native_bf16": cpu.native_bf16,
                "reason": cpu.reason, "cores": os.cpu_count(),
                "torch_threads": torch.get_num_threads()},
        "resolved": {"dtype_auto": resolve_dtype_name("auto", device, cap),
                     "train_precision_auto": train_precision("auto", device, cap),
                     "device": device, "reason": cap.reason},
        "decode_kernel": kernel_state() if not cuda else {"state": "not used on a GPU"},
        "matmul_gflops": {name: round(matmul_gflops(dt, matmul_seconds, device), 1)
                          for name, dt in (("float32", torch.float32),
                                           ("bfloat16", torch.bfloat16))},
        "versions": versions(),
    }
    if with_ray:
        report["ray"] = ray_resources()
    if device == "cpu":
        dtype = report["resolved"]["dtype_auto"]
        report["quickstart_rate"] = quickstart_rate(getattr(torch, dtype), matmul_seconds,
                                                    report["matmul_gflops"][dtype])
    minutes = quickstart_minutes(report)
    report["quickstart_minutes"] = None if minutes is None else round(minutes, 1)
    report["verdict"] = verdict(report)
    return report


def verdict(report: dict) -> list[str]:
    """What will be slow on this machine, one line each, from a :func:`gather` report."""
    lines = []
    rates = report["matmul_gflops"]
    if report["device"] == "cpu" and not report["cpu"]["native_bf16"]:
        lines.append(f"bf16 is emulated on this CPU ({report['cpu']['capability']}, no "
                     f"avx512_bf16 or amx): dtype auto runs fp32 here; a config that sets "
                     f"bfloat16 explicitly runs "
                     f"~{rates['float32'] / max(rates['bfloat16'], 1e-9):.0f}x "
                     f"slower in its matmuls")
    elif rates["bfloat16"] < EMULATED_RATIO * rates["float32"]:
        lines.append(f"bf16 matmuls measured slower than fp32 ({rates['bfloat16']} vs "
                     f"{rates['float32']} GFLOP/s) although the device reports native bf16: the "
                     f"machine may be loaded; set dtype: float32 if this persists")
    if (report["cpu"]["torch_threads"] or 0) < 2:
        lines.append("torch uses 1 thread: the engine and training will be slow (set "
                     "OMP_NUM_THREADS or the configs' num_threads)")
    kernel = report["decode_kernel"]
    if kernel.get("state", "").startswith("cannot"):
        lines.append("no C++ compiler: the decode attention kernel cannot be built; the engine "
                     "attends with PyTorch (slower); install g++")
    minutes = report.get("quickstart_minutes")
    if minutes is not None and minutes + INSTALL_ALLOWANCE_MIN > QUICKSTART_PROMISE_MIN:
        dtype = report["resolved"]["dtype_auto"]
        lines.append(f"the quickstart should take ~{minutes + INSTALL_ALLOWANCE_MIN:.0f} min here "
                     f"(pipeline ~{minutes:.0f}, install ~{INSTALL_ALLOWANCE_MIN:.0f}): "
                     f"~{QUICKSTART_WORK_GFLOP[dtype] / 1000:.0f} k GFLOP-equivalents of "
                     f"{dtype} work at the {report['quickstart_rate']} GFLOP/s measured at "
                     f"{QUICKSTART_THREADS} threads; the README's times are for faster CPUs "
                     f"(docs/measurements.md)")
    if "error" in report.get("ray", {}):
        lines.append(f"Ray did not start: {report['ray']['error']}")
    return lines


def render(report: dict) -> str:
    """The report as readable lines."""
    cpu, res = report["cpu"], report["resolved"]
    rates = report["matmul_gflops"]
    lines = [
        f"device          {report['device']}",
        f"cpu             {cpu['model']} ({cpu['capability']}; {cpu['cores']} cores, torch "
        f"threads {cpu['torch_threads']})",
        f"bf16            {'native' if cpu['native_bf16'] else 'emulated'}: {cpu['reason']}",
        f"dtype auto      {res['dtype_auto']} on {res['device']} ({res['reason']})",
        f"train precision auto -> {res['train_precision_auto']}",
        f"decode kernel   {report['decode_kernel'].get('state')}"
        + (f"; {report['decode_kernel']['path']}" if "path" in report["decode_kernel"] else ""),
        f"matmul          float32 {rates['float32']} GFLOP/s, bfloat16 {rates['bfloat16']} "
        f"GFLOP/s ({' x '.join(map(str, MATMUL_SHAPE))})",
    ]
    if report.get("quickstart_minutes") is not None:
        lines.append(f"quickstart      ~{report['quickstart_minutes']:.0f} min for its pipeline "
                     f"here, install aside (from the {res['dtype_auto']} rate measured now: "
                     f"other work on the machine makes it read long)")
    if "ray" in report:
        ray = report["ray"]
        lines.append(f"ray             {ray['version']} ({ray['address']}): "
                     + (json.dumps(ray["resources"]) if "resources" in ray else ray.get("error")))
    lines.append("versions        " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()
                                                 if v))
    lines += [f"verdict         {v}" for v in report["verdict"]] or [
        "verdict         nothing here should be slow"]
    return "\n".join(lines)


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-ray", action="store_true", help="skip Ray's resources")
    parser.add_argument("--matmul-seconds", type=_seconds, default=1.0,
                        help="seconds per dtype for the matmul rates")
    args = parser.parse_args(argv)
    report = gather(args.matmul_seconds, with_ray=not args.no_ray)
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
