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
    for label in ("device", "cpu", "bf16", "dtype auto", "train precision", "decode kernel",
                  "matmul", "versions", "verdict"):
        assert any(line.startswith(label) for line in out.splitlines()), label
