"""``python -m pipeline.doctor`` on the machine it runs on (issue 41): its resolved dtype agrees
with the capability it reports, whatever the CPU class, and its verdict names emulated bf16."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline import doctor


def test_the_report_agrees_with_itself_on_this_machine(capsys):
    assert doctor.main(["--json", "--no-ray", "--matmul-seconds", "0.05"]) == 0
    report = json.loads(capsys.readouterr().out)
    cpu, resolved = report["cpu"], report["resolved"]
    assert cpu["capability"] == torch.backends.cpu.get_cpu_capability()
    if report["device"] == "cpu":
        assert resolved["dtype_auto"] == ("bfloat16" if cpu["native_bf16"] else "float32")
        assert resolved["train_precision_auto"] == ("bf16" if cpu["native_bf16"] else "fp32")
        emulated = [v for v in report["verdict"] if "bf16 is emulated" in v]
        assert bool(emulated) is (not cpu["native_bf16"])
    if report["device"] == "cpu":  # the kernel's reported paths are its build's rule
        from serve.engine.decode_attention import expected_paths

        assert report["decode_kernel"]["paths"] == expected_paths()
    assert all(rate > 0 for rate in report["matmul_gflops"].values())
    if report["device"] == "cpu":  # the prediction reads the rate of the dtype auto runs
        dtype = resolved["dtype_auto"]
        assert report["quickstart_rate"] > 0
        assert report["quickstart_minutes"] == round(
            doctor.QUICKSTART_WORK_GFLOP[dtype] / report["quickstart_rate"] / 60, 1)
    assert report["versions"]["torch"] == torch.__version__


def test_the_verdict_names_what_will_be_slow():
    base = {"device": "cpu", "matmul_gflops": {"float32": 124.0, "bfloat16": 1.0},
            "cpu": {"native_bf16": False, "capability": "AVX2", "torch_threads": 1},
            "decode_kernel": {"state": "cannot be built (no C++ compiler): ..."},
            "ray": {"error": "TimeoutError: node start"}}
    lines = doctor.verdict(base)
    assert any("bf16 is emulated" in l and "~124x slower" in l for l in lines)
    assert any("1 thread" in l for l in lines)
    assert any("no C++ compiler" in l for l in lines)
    assert any("Ray did not start" in l for l in lines)
    healthy = {**base, "matmul_gflops": {"float32": 200.0, "bfloat16": 870.0},
               "cpu": {"native_bf16": True, "capability": "AVX512", "torch_threads": 2},
               "decode_kernel": {"state": "built"}, "ray": {"resources": {"CPU": 2}}}
    assert doctor.verdict(healthy) == []
    loaded = {**healthy, "matmul_gflops": {"float32": 200.0, "bfloat16": 50.0}}
    assert any("slower than fp32" in l for l in doctor.verdict(loaded))


def test_the_text_report_has_a_line_per_question(capsys):
    doctor.main(["--no-ray", "--matmul-seconds", "0.05"])
    out = capsys.readouterr().out
    labels = ["device", "cpu", "bf16", "dtype auto", "train precision", "decode kernel",
              "matmul", "versions", "verdict"]
    if not torch.cuda.is_available():
        labels.append("quickstart")
    for label in labels:
        assert any(line.startswith(label) for line in out.splitlines()), label


def _resolved(device: str, dtype: str, rate: float) -> dict:
    return {"resolved": {"device": device, "dtype_auto": dtype}, "quickstart_rate": rate}


def test_the_quickstart_prediction_follows_the_rate_of_the_resolved_dtype():
    work = doctor.QUICKSTART_WORK_GFLOP
    # the fit reproduces the runs it was made from (docs/measurements.md): a check of the
    # constants' arithmetic, not of the prediction's accuracy on other machines
    for dtype, rate, measured_s in (("float32", 65.0, 846),):
        minutes = doctor.quickstart_minutes(_resolved("cpu", dtype, rate))
        assert abs(minutes * 60 / measured_s - 1) < 0.1, (dtype, rate, minutes)
    # half the rate, twice the time; bf16 work is priced apart from fp32
    assert doctor.quickstart_minutes(_resolved("cpu", "float32", 50.0)) == pytest.approx(
        2 * doctor.quickstart_minutes(_resolved("cpu", "float32", 100.0)))
    assert (doctor.quickstart_minutes(_resolved("cpu", "bfloat16", 100.0))
            > doctor.quickstart_minutes(_resolved("cpu", "float32", 100.0)))
    # bf16 priced by the ratio the earlier quickstart measured (264 k / 176 k)
    assert work["bfloat16"] / work["float32"] == pytest.approx(1.5)
    assert doctor.quickstart_minutes(_resolved("cuda", "bfloat16", 9e4)) is None
    assert doctor.quickstart_minutes(_resolved("cpu", "float32", 0.0)) is None
    assert doctor.quickstart_minutes(_resolved("cpu", "float16", 100.0)) is None


def test_the_quickstart_rate_is_measured_at_the_quickstarts_threads(monkeypatch):
    """On a machine with more cores than the quickstart's 2 threads use, the rate the prediction
    reads is measured at 2 (else a 16-core box would be predicted 8x too fast)."""
    seen = []
    monkeypatch.setattr(doctor, "matmul_gflops",
                        lambda dtype, seconds, device="cpu": seen.append(
                            torch.get_num_threads()) or 10.0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert doctor.quickstart_rate(torch.float32, 0.01, measured=99.0) == 10.0
        assert seen == [doctor.QUICKSTART_THREADS] and torch.get_num_threads() == 1
        torch.set_num_threads(doctor.QUICKSTART_THREADS)  # already at 2: the report's rate
        assert doctor.quickstart_rate(torch.float32, 0.01, measured=99.0) == 99.0
        assert len(seen) == 1
    finally:
        torch.set_num_threads(before)


def test_the_verdict_warns_when_the_quickstart_will_run_long():
    base = {"device": "cpu", "matmul_gflops": {"float32": 30.0, "bfloat16": 30.0},
            "resolved": {"device": "cpu", "dtype_auto": "float32"}, "quickstart_rate": 30.0,
            "cpu": {"native_bf16": False, "capability": "AVX2", "torch_threads": 2},
            "decode_kernel": {"state": "built"}, "ray": {"resources": {"CPU": 2}}}
    slow = {**base, "quickstart_minutes": doctor.quickstart_minutes(base)}  # 30.6
    lines = [l for l in doctor.verdict(slow) if "bf16 is emulated" not in l]
    assert len(lines) == 1 and "~35 min" in lines[0] and "pipeline ~31" in lines[0]
    assert "30.0 GFLOP/s" in lines[0]
    # the bar counts the install: a pipeline of 17 minutes misses 20 with it
    assert any("quickstart" in l for l in doctor.verdict({**base, "quickstart_minutes": 17.0}))
    assert not any("quickstart" in l for l in doctor.verdict({**base, "quickstart_minutes": 14.0}))
