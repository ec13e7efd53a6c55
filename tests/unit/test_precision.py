"""``dtype: auto`` and ``train.precision: auto`` (issue 41): every resolution branch with an
injected capability (CUDA with and without bf16, a CPU with native bf16, one without, an explicit
dtype), the machine's own capability against what its CPU flags say (so the test holds on an
AVX2-only and an AVX-512-BF16 machine alike), the defaults of every config, the training
precision (DeepSpeed's autocast section only where bf16 is native), and a target cache written
from either compute dtype reading back the same bf16 format."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from drafters.precision import (Capability, capability, resolve_dtype, resolve_dtype_name,
                                train_precision)

CUDA_BF16 = Capability("cuda", "H200", True, True, "H200: bf16 supported")
CUDA_OLD = Capability("cuda", "Tesla V100", False, True, "Tesla V100: bf16 not supported")
CPU_BF16 = Capability("cpu", "AVX512", True, False, "CPU AVX512 with avx512_bf16")
CPU_AVX2 = Capability("cpu", "AVX2", False, False, "CPU AVX2 without avx512_bf16 or amx")


@pytest.mark.parametrize("cap, want", [(CUDA_BF16, torch.bfloat16), (CUDA_OLD, torch.float32),
                                       (CPU_BF16, torch.bfloat16), (CPU_AVX2, torch.float32)])
def test_auto_is_bf16_exactly_where_it_is_native(cap, want):
    assert resolve_dtype("auto", cap=cap) == want
    assert train_precision("auto", cap=cap) == ("bf16" if want == torch.bfloat16 else "fp32")


@pytest.mark.parametrize("cap", [CUDA_BF16, CPU_BF16, CPU_AVX2])
@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_always_wins(cap, name):
    assert resolve_dtype_name(name, cap=cap) == name
    if name != "float16":
        assert train_precision({"float32": "fp32", "bfloat16": "bf16"}[name], cap=cap) == \
            {"float32": "fp32", "bfloat16": "bf16"}[name]


def test_bf16_on_a_cpu_without_it_warns_with_the_slowdown(caplog):
    from drafters import precision

    precision._logged.discard(("bfloat16", "cpu"))
    with caplog.at_level(logging.WARNING, logger="drafters.precision"):
        assert resolve_dtype("bfloat16", cap=CPU_AVX2) == torch.bfloat16
    assert any("~4x slower than float32" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="drafters.precision"):
        resolve_dtype("bfloat16", cap=CPU_AVX2)  # logged once per process
        resolve_dtype("bfloat16", cap=CPU_BF16)  # native: nothing to warn about
    assert not caplog.records


def test_auto_is_logged_once_with_its_reason(caplog):
    from drafters import precision

    precision._logged.discard(("auto", "cpu"))
    with caplog.at_level(logging.INFO, logger="drafters.precision"):
        resolve_dtype("auto", cap=CPU_AVX2)
        resolve_dtype("auto", cap=CPU_AVX2)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["dtype auto -> float32 (CPU AVX2 without avx512_bf16 or amx)"]


def test_unknown_names_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="'auto', 'float32', 'bfloat16', 'float16'"):
        resolve_dtype("bf16")
    with pytest.raises(ValueError, match="auto, bf16 or fp32"):
        train_precision("bfloat16")


def test_this_machines_capability_agrees_with_its_cpu_flags():
    """Whatever class the machine is: native bf16 exactly when the CPU reports avx512_bf16 or
    AMX tiles, and auto resolves accordingly."""
    flags = next((line.split(":", 1)[1].split() for line in
                  Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), None)
    if flags is None:
        pytest.skip("no /proc/cpuinfo flags on this platform")
    cap = capability("cpu")
    dispatched = torch.backends.cpu.get_cpu_capability()  # narrowed by ATEN_CPU_CAPABILITY?
    assert cap.native_bf16 == (("avx512_bf16" in flags or "amx_tile" in flags)
                               and dispatched.startswith(("AVX512", "AMX"))), cap
    assert cap.name == torch.backends.cpu.get_cpu_capability()
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if cap.native_bf16 else torch.float32)


def test_an_unseen_cuda_device_is_planned_as_bf16():
    if torch.cuda.is_available():
        pytest.skip("this process sees a GPU")
    assert capability("cuda").native_bf16 and resolve_dtype("auto", "cuda") == torch.bfloat16


def test_every_precision_setting_defaults_to_auto():
    from pipeline.config import CalibrateConfig, EvalConfig, TargetConfig, TrainConfig
    from serve.config import ServeConfig

    assert TargetConfig(name_or_path="x").dtype == "auto"
    assert CalibrateConfig().dtype == "auto" and EvalConfig().dtype == "auto"
    assert TrainConfig.model_fields["precision"].default == "auto"
    assert ServeConfig.model_fields["dtype"].default == "auto"


def test_shipped_configs_leave_precision_to_the_machine():
    """No shipped config hard-codes bf16 (an AVX2-only CPU emulates it ~4x slower)."""
    import yaml

    root = Path(__file__).resolve().parents[2] / "infra" / "configs"

    def walk(node, where):
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("dtype", "baseline_dtype", "precision"):
                    assert v == "auto", f"{where}: {k} = {v!r}"
                walk(v, where)
        elif isinstance(node, list):
            for v in node:
                walk(v, where)

    for path in sorted(root.glob("*.yaml")):
        walk(yaml.safe_load(path.read_text()), path.name)


def test_deepspeed_autocasts_bf16_only_where_training_resolves_to_it(monkeypatch):
    from drafters import precision
    from pipeline.config import TrainConfig
    from pipeline.train.worker import deepspeed_config, uses_bf16

    tc = TrainConfig(use_gpu=True, global_batch_size=8, micro_batch_size=4, num_workers=1)
    for cap, autocast in ((CUDA_BF16, True), (CUDA_OLD, False)):
        monkeypatch.setattr(precision, "_capability", lambda kind, cap=cap: cap)
        assert uses_bf16(tc) is autocast
        assert ("torch_autocast" in deepspeed_config(tc, 1)) is autocast
    cpu = tc.model_copy(update={"use_gpu": False})
    for cap in (CPU_BF16, CPU_AVX2):
        monkeypatch.setattr(precision, "_capability", lambda kind, cap=cap: cap)
        assert uses_bf16(cpu) is cap.native_bf16
        assert "torch_autocast" not in deepspeed_config(cpu, 1)  # CPU: autocast in the loop


def test_a_cache_row_is_the_same_bf16_format_from_either_compute_dtype():
    """The cache is bf16 on disk whatever the target computed in: rows written from an fp32 and
    a bf16 forward (an AVX2 and an AVX-512-BF16 machine's auto) have the same schema and
    byte layout and decode to bf16 tensors, equal where the values are."""
    from pipeline.cache.format import decode_row
    from pipeline.cache.writer import rows_table

    g = torch.Generator().manual_seed(0)
    ctx32, last32 = torch.randn(5, 2 * 8, generator=g), torch.randn(5, 8, generator=g)
    sample = {"sample_id": "s0", "domain": "math", "input_ids": list(range(5)),
              "loss_mask": [0, 1, 1, 1, 1]}
    rows = [rows_table([sample], [ctx], [last]).to_pylist()[0]
            for ctx, last in ((ctx32, last32), (ctx32.bfloat16(), last32.bfloat16()))]
    assert rows[0] == rows[1]  # byte-identical: bf16 of the same values
    decoded = decode_row(rows[0], hidden_size=8, num_context_layers=2)
    assert decoded["context_hidden"].dtype == torch.bfloat16
    assert torch.equal(decoded["context_hidden"], ctx32.bfloat16())
    np.testing.assert_array_equal(decoded["input_ids"].numpy(), np.arange(5))


def test_load_target_resolves_auto_on_this_machine(smollm2_dir):
    from drafters.target_weights import load_target

    model = load_target(str(smollm2_dir), "auto", "cpu")
    assert model.dtype == resolve_dtype("auto", "cpu")


def test_a_driver_planning_for_gpu_workers_never_probes_the_device(monkeypatch):
    """The memory planner resolves precision for GPU workers without a CUDA context in the
    driver (it would hold GPU memory vLLM or the trainers need): bf16 assumed."""
    from pipeline.config import TrainConfig
    from pipeline.train.worker import uses_bf16

    def refuse(*args, **kwargs):
        raise AssertionError("the driver probed the GPU")

    monkeypatch.setattr(torch.cuda, "get_device_name", refuse)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", refuse)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert capability("cuda", probe=False).native_bf16
    tc = TrainConfig(use_gpu=True, global_batch_size=8, micro_batch_size=4, num_workers=1)
    assert uses_bf16(tc, probe=False)


def test_a_gpu_with_only_emulated_bf16_resolves_to_fp32(monkeypatch):
    """torch's is_bf16_supported() also says yes where bf16 is emulated (compute < 8.0): auto
    asks for native support only."""
    from drafters import precision

    asked = {}

    def supported(including_emulation=True):
        asked["including_emulation"] = including_emulation
        return including_emulation  # a V100: emulated yes, native no

    precision._capability.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", supported)
    try:
        assert resolve_dtype("auto", "cuda") == torch.float32
        assert asked == {"including_emulation": False}
    finally:
        precision._capability.cache_clear()


def test_torch_told_to_dispatch_avx2_kernels_is_an_avx2_machine(monkeypatch):
    """ATEN_CPU_CAPABILITY=avx2 on a CPU with avx512_bf16 (reproducing an AVX2-only machine):
    auto resolves to fp32, and the reason says why."""
    from drafters import precision

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setattr(precision, "_cpu_check", lambda name: name == "_is_avx512_bf16_supported")
    precision._capability.cache_clear()
    try:
        cap = capability("cpu")
        assert not cap.native_bf16 and "ATEN_CPU_CAPABILITY" in cap.reason
        assert resolve_dtype("auto", "cpu", cap) == torch.float32
    finally:
        precision._capability.cache_clear()
