"""``python -m pipeline.doctor`` on the machine it runs on (issue 41): its resolved dtype agrees
with the capability it reports, whatever the CPU class, and its verdict names emulated bf16."""

from __future__ import annotations

import json

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
        assert report["quickstart_minutes"] == round(
            doctor.QUICKSTART_WORK_GFLOP[dtype] / report["matmul_gflops"][dtype] / 60, 1)
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


def _resolved(device: str, dtype: str, fp32: float, bf16: float) -> dict:
    return {"resolved": {"device": device, "dtype_auto": dtype},
            "matmul_gflops": {"float32": fp32, "bfloat16": bf16}}


def test_the_quickstart_prediction_follows_the_rate_of_the_resolved_dtype():
    work = doctor.QUICKSTART_WORK_GFLOP
    # the measured runs it was fitted on come back within 10 % (docs/measurements.md)
    runs = (("float32", 173.0, 2.2, 1045), ("float32", 64.0, 1.2, 2669),
            ("bfloat16", 184.0, 419.0, 629))
    for dtype, fp32, bf16, measured_s in runs:
        minutes = doctor.quickstart_minutes(_resolved("cpu", dtype, fp32, bf16))
        assert abs(minutes * 60 / measured_s - 1) < 0.1, (dtype, fp32, minutes)
    # half the rate, twice the time; the other dtype's rate is not read
    slow = doctor.quickstart_minutes(_resolved("cpu", "float32", 50.0, 999.0))
    assert slow == work["float32"] / 50.0 / 60 == 2 * doctor.quickstart_minutes(
        _resolved("cpu", "float32", 100.0, 0.1))
    assert doctor.quickstart_minutes(_resolved("cuda", "bfloat16", 9e4, 9e4)) is None
    assert doctor.quickstart_minutes(_resolved("cpu", "float32", 0.0, 1.0)) is None


def test_the_verdict_warns_when_the_quickstart_will_run_long():
    base = {"device": "cpu", "matmul_gflops": {"float32": 64.0, "bfloat16": 1.2},
            "resolved": {"device": "cpu", "dtype_auto": "float32"},
            "cpu": {"native_bf16": True, "capability": "AVX2", "torch_threads": 2},
            "decode_kernel": {"state": "built"}, "ray": {"resources": {"CPU": 2}}}
    base["matmul_gflops"]["bfloat16"] = 64.0  # keep the emulated-bf16 lines out of this test
    slow = {**base, "quickstart_minutes": doctor.quickstart_minutes(base)}
    lines = doctor.verdict(slow)
    assert len(lines) == 1 and "~46 min" in lines[0] and "64.0 GFLOP/s" in lines[0]
    fast = {**base, "quickstart_minutes": 12.0}
    assert doctor.verdict(fast) == []
