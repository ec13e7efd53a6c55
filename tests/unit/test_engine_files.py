"""Engine files (serve/engine/engine_files.py): STS temperatures and SPS(B) in SGLang's and
TensorRT-LLM's formats, and this project's loader refusing a file measured for something else.

Neither engine is installed here (SGLang's parsers need msgspec and the sglang package,
TensorRT-LLM's need the tensorrt_llm wheel and CUDA), so the upstream checks are SCHEMA TESTS
MIRRORED FROM THE UPSTREAM LOADERS, written from their source, not the parsers themselves:

- SGLang (sgl-project/sglang, python/sglang/srt/speculative/dspark_components/):
  ``dspark_sts.py`` ``DSparkStsCalibration`` (a msgspec.Struct: ``temperatures: list[float]``
  required and all > 0, ``dataset: str``, ``num_samples: int``, ``ece_before`` / ``ece_after:
  list[float]``; msgspec ignores unknown keys by default, so ``provenance`` is allowed) and
  ``dspark_planner.py`` (refuses ``len(temperatures) != gamma``); ``dspark_sps.py``
  ``load_sps_table_from_path`` (a text containing ``"bias_seconds"`` is read as the additive
  table) and ``SpsCostTable`` (``sample_batch_tokens: list[int]`` strictly increasing,
  ``sample_steps_per_sec: list[float]`` of equal length, ``max_batch_tokens: int`` >= the last
  sample; ``lookup`` = the value at the largest sample <= B, clamped).
- TensorRT-LLM (NVIDIA/TensorRT-LLM, tensorrt_llm/_torch/speculative/): ``dspark_sts.py``
  ``load_sts_temperatures_from_path`` (``sts_temperatures``, else ``temperatures``; non-empty);
  ``dspark_planner.py`` ``SpsCostTable`` (``token_counts`` strictly increasing,
  ``step_time_ms`` positive and finite, ``fixed_overhead_ms`` >= 0, ``batch_sizes`` /
  ``batch_overhead_ms`` of equal length; ``step_time = numpy.interp(M, token_counts,
  step_time_ms) + fixed_overhead_ms + alpha(bs)``), ``check_table_fingerprint`` (keys of
  ``_meta.engine`` shared with the live engine must agree: numbers as floats, else
  case-insensitive strings) and the legacy branch of ``load_runtime_sps_cost_table`` (a payload
  with a schema-v2 marker key is an exact table, not a curve); ``dspark.py`` warns unless
  ``_meta.lookup == "interp"``.
"""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from serve.engine.engine_files import (EngineFileError, EngineFileMismatch, drafter_facts,
                                load_engine_file, main, write_engine_files)
from serve.engine.profiling import load_or_profile
from serve.engine.target_runner import TargetRunner
from tests.tiny import tiny_drafter, tiny_target

GAMMA = 4
TEMPS = [1.5, 2.0, 0.8, 1.1]


# ------------------------------------------------------------------ the upstream loaders, mirrored
def _is_int(v) -> bool:  # msgspec's int: a JSON integer, not a float or bool
    return type(v) is int


def _is_float(v) -> bool:  # msgspec's float accepts JSON integers too
    return type(v) in (int, float)


def sglang_load_sts(text: str, runtime_gamma: int) -> list[float]:
    """DSparkStsCalibration.from_json, then DSparkVerifyPlanner's gamma check."""
    obj = json.loads(text)
    assert isinstance(obj, dict)
    temps = obj["temperatures"]
    assert isinstance(temps, list) and all(_is_float(t) for t in temps)
    assert isinstance(obj.get("dataset", ""), str) and _is_int(obj.get("num_samples", 0))
    for key in ("ece_before", "ece_after"):
        assert isinstance(obj.get(key, []), list) and all(_is_float(v) for v in obj.get(key, []))
    if not temps or any(t <= 0 for t in temps):
        raise ValueError("DSparkStsCalibration requires temperatures, all > 0")
    if len(temps) != runtime_gamma:
        raise ValueError("DSpark STS calibration was fit for another gamma")
    return [float(t) for t in temps]


def sglang_load_sps(text: str):
    """load_sps_table_from_path -> SpsCostTable; returns (lookup, max_batch_tokens)."""
    assert '"bias_seconds"' not in text, "SGLang would read this as SpsAdditiveCostTable"
    obj = json.loads(text)
    xs, ys, top = obj["sample_batch_tokens"], obj["sample_steps_per_sec"], obj["max_batch_tokens"]
    assert all(_is_int(x) for x in xs) and all(_is_float(y) for y in ys) and _is_int(top)
    if not xs or xs != sorted(set(xs)) or len(xs) != len(ys) or top < xs[-1]:
        raise ValueError("SpsCostTable invariants violated")

    def lookup(batch_tokens: int) -> float:
        idx = bisect.bisect_right(xs, batch_tokens) - 1
        return ys[max(0, min(idx, len(xs) - 1))]
    return lookup, top


def trtllm_load_sts(text: str) -> list[float]:
    """load_sts_temperatures_from_path."""
    obj = json.loads(text)
    for key in ("sts_temperatures", "temperatures"):
        if key in obj:
            temps = obj[key]
            break
    else:
        raise KeyError("neither 'sts_temperatures' nor 'temperatures'")
    if not temps:
        raise ValueError("empty temperature vector")
    return [float(t) for t in temps]


V2_MARKERS = {"cost_tables", "engine_fingerprint", "engine_fingerprint_sha256", "measurements",
              "schema_version"}


def trtllm_load_sps(text: str, live: dict):
    """The worker's legacy-curve path: _meta.lookup, check_table_fingerprint, SpsCostTable.
    Returns step_time(M, num_requests) in ms."""
    raw = json.loads(text)
    assert isinstance(raw, dict) and not V2_MARKERS & set(raw), "read as a schema-v2 table"
    assert (raw.get("_meta") or {}).get("lookup") == "interp", "TensorRT-LLM would warn"
    fp = (raw.get("_meta") or {}).get("engine") or raw.get("engine")
    assert fp, "TensorRT-LLM would warn: no engine fingerprint"

    def differ(a, b) -> bool:
        try:
            return float(a) != float(b)
        except (TypeError, ValueError):
            return str(a).upper() != str(b).upper()
    bad = [k for k in set(fp) & set(live) if differ(fp[k], live[k])]
    if bad:
        raise ValueError(f"DSpark cost table was profiled on a different engine ({bad})")
    xs = [int(v) for v in raw["token_counts"]]
    ms = [float(v) for v in raw["step_time_ms"]]
    fixed = float(raw.get("fixed_overhead_ms", 0.0))
    bs = [int(v) for v in raw.get("batch_sizes", [])]
    alpha = [float(v) for v in raw.get("batch_overhead_ms", [])]
    if (len(xs) != len(ms) or not xs or any(b <= a for a, b in zip(xs, xs[1:]))
            or any(not math.isfinite(t) or t <= 0 for t in ms) or fixed < 0
            or len(bs) != len(alpha)):
        raise ValueError("SpsCostTable invariants violated")

    def step_time(m: int, num_requests: int = 0) -> float:
        over = float(np.interp(num_requests, bs, alpha)) if bs else 0.0
        return float(np.interp(m, xs, ms)) + fixed + over
    return step_time


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A calibrated tiny drafter with a real stored SPS profile and a calibrate report, and its
    engine files."""
    root = tmp_path_factory.mktemp("engine_files")
    target = tiny_target()
    target.config.name_or_path = "tiny-qwen3"
    drafter = tiny_drafter(target, block_size=GAMMA)
    drafter.config.calibration_temperatures = TEMPS
    ddir = root / "calibrate" / "drafter"
    drafter.save_pretrained(ddir)
    table = load_or_profile(TargetRunner(target, [1, 3]), ddir, 10, block_tokens=GAMMA + 1,
                            repeats=1)
    rows = [{"position": k + 1, "ece_before": 0.05, "ece_after": 0.02} for k in range(GAMMA)]
    (root / "calibrate" / "report.json").write_text(json.dumps(
        {"calibrated": True, "temperatures": TEMPS, "fit_rounds": 123, "dtype": "float32",
         "device": "test-cpu", "report": {"positions": rows}}))
    summary = write_engine_files(ddir, root / "out")
    return SimpleNamespace(root=root, drafter=ddir, out=root / "out", table=table,
                           summary=summary, facts=drafter_facts(ddir), target=target)


def _text(ex, name: str) -> str:
    return (ex.out / name).read_text()


# ----------------------------------------------------------------------------- upstream formats
def test_writes_both_engines_files_and_a_readme(exported):
    assert exported.summary["written"] == ["sglang/sps_table.json", "sglang/sts_calibration.json",
                                           "trtllm/sps_cost_table.json",
                                           "trtllm/sts_calibration.json"]
    assert exported.summary["skipped"] == {}
    readme = _text(exported, "README.md")
    assert "--speculative-dspark-sps-table-path sglang/sps_table.json" in readme
    assert "confidence_sps_table_path: trtllm/sps_cost_table.json" in readme


def test_sglang_files_load_as_sglang_loads_them(exported):
    temps = sglang_load_sts(_text(exported, "sglang/sts_calibration.json"), runtime_gamma=GAMMA)
    assert temps == TEMPS
    with pytest.raises(ValueError, match="another gamma"):  # SGLang serving gamma 5 refuses it
        sglang_load_sts(_text(exported, "sglang/sts_calibration.json"), runtime_gamma=GAMMA + 1)
    sts = json.loads(_text(exported, "sglang/sts_calibration.json"))
    assert sts["num_samples"] == 123 and sts["ece_after"] == [0.02] * GAMMA
    lookup, top = sglang_load_sps(_text(exported, "sglang/sps_table.json"))
    table = exported.table
    assert top == table.max_tokens == 10
    # steps/s at B = requests + verified drafts, the same B as this engine's SPS(B)
    assert [lookup(b) for b in range(1, top + 1)] == pytest.approx(list(table.sps_by_batch))
    assert lookup(top + 50) == table.sps(top)  # clamped past the table, as SGLang does


def test_trtllm_files_load_as_trtllm_loads_them(exported):
    assert trtllm_load_sts(_text(exported, "trtllm/sts_calibration.json")) == TEMPS
    live = {"tp": 1, "ep": 1, "attention_dp": False, "block": GAMMA, "max_batch_size": 64}
    step_time = trtllm_load_sps(_text(exported, "trtllm/sps_cost_table.json"), live)
    table = exported.table
    # milliseconds per step at M total verified tokens (bonus / anchor included)
    assert [1000.0 / step_time(m, 3) for m in range(1, 11)] == pytest.approx(
        list(table.sps_by_batch))
    for other in ({"block": GAMMA + 1}, {"tp": 8}):  # TensorRT-LLM's own refusal
        with pytest.raises(ValueError, match="different engine"):
            trtllm_load_sps(_text(exported, "trtllm/sps_cost_table.json"), {**live, **other})


def test_every_file_records_what_it_was_measured_on(exported):
    for name in exported.summary["written"]:
        prov = json.loads(_text(exported, name))["provenance"]
        assert prov["producer"] == "dspark-ray" and prov["target_model"] == "tiny-qwen3"
        assert prov["gamma"] == GAMMA and prov["verify_tokens_per_request"] == GAMMA + 1
        assert prov["drafter_weights_sha256"] == exported.facts["drafter_weights_sha256"]
        assert prov["created"].endswith("Z")
        if prov["kind"] == "sps":
            assert prov["hardware"]["device_type"] == "cpu" and prov["hardware"]["device"]
            assert prov["dtype"] == "float32" and prov["measured_at"]
            assert prov["measured_batch_tokens"] == [1, 2, 3, 4, 5, 6, 7, 8, 10]
        else:
            assert prov["calibrated"] and prov["dtype"] == "float32"


# ------------------------------------------------------------------------ this project's loader
def test_round_trip_through_this_projects_loader(exported):
    hw = json.loads(_text(exported, "sglang/sps_table.json"))["provenance"]["hardware"]
    for name in ("sglang/sps_table.json", "trtllm/sps_cost_table.json"):
        f = load_engine_file(exported.out / name, target_model="/models/tiny-qwen3",
                             block_size=GAMMA, hardware={"device": hw["device"], "device_type": "cpu"},
                             dtype="torch.float32")
        assert f.kind == "sps"
        assert f.sps.sps_by_batch == pytest.approx(exported.table.sps_by_batch)
    for name in ("sglang/sts_calibration.json", "trtllm/sts_calibration.json"):
        f = load_engine_file(exported.out / name, target_model="tiny-qwen3", block_size=GAMMA,
                             drafter_sha256=exported.facts["drafter_weights_sha256"])
        assert f.kind == "sts" and list(f.temperatures) == TEMPS


@pytest.mark.parametrize("name", ["sglang/sps_table.json", "trtllm/sps_cost_table.json"])
@pytest.mark.parametrize("kwargs,field", [
    ({"target_model": "Qwen/Qwen3-4B"}, "target model"),
    ({"block_size": GAMMA + 3}, "gamma"),
    ({"hardware": {"device": "NVIDIA H200", "device_type": "cuda"}}, "hardware device"),
    ({"dtype": "bfloat16"}, "dtype"),
])
def test_a_mismatched_sps_table_is_refused(exported, name, kwargs, field):
    with pytest.raises(EngineFileMismatch, match=field):
        load_engine_file(exported.out / name, **kwargs)


@pytest.mark.parametrize("name", ["sglang/sts_calibration.json", "trtllm/sts_calibration.json"])
def test_mismatched_temperatures_are_refused(exported, name):
    with pytest.raises(EngineFileMismatch, match="gamma: file 4, expected 7"):
        load_engine_file(exported.out / name, block_size=7)
    with pytest.raises(EngineFileMismatch, match="drafter: fitted for weights"):
        load_engine_file(exported.out / name, drafter_sha256="0" * 64)


def test_files_without_provenance_or_malformed_are_refused(exported, tmp_path):
    bare = json.loads(_text(exported, "sglang/sps_table.json"))
    del bare["provenance"]
    (tmp_path / "bare.json").write_text(json.dumps(bare))
    with pytest.raises(EngineFileError, match="no dspark-ray provenance"):
        load_engine_file(tmp_path / "bare.json", block_size=GAMMA)
    bad = json.loads(_text(exported, "trtllm/sps_cost_table.json"))
    bad["token_counts"] = bad["token_counts"][::-1]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(EngineFileError, match="strictly increasing"):
        load_engine_file(tmp_path / "bad.json")


# ----------------------------------------------------------------------------- writer refusals
def test_a_profile_of_another_target_is_not_exported(exported, tmp_path):
    profile = json.loads((exported.drafter / "sps_profile.json").read_text())
    profile["fingerprint"] = {**profile["fingerprint"], "model": "Qwen/Qwen3-4B",
                              "hidden_size": 2560}
    with pytest.raises(EngineFileMismatch, match="Qwen3-4B"):
        write_engine_files(exported.drafter, tmp_path / "x", sps_profile=profile)


def test_no_confidence_head_or_no_profile_skips_with_the_reason(tmp_path):
    target = tiny_target()
    ddir = tmp_path / "dflash"
    tiny_drafter(target, drafter_type="dflash").save_pretrained(ddir)
    out = write_engine_files(ddir, tmp_path / "out")
    assert out["written"] == []
    assert "no confidence head" in out["skipped"]["sts"]
    assert "sps_profile.json" in out["skipped"]["sps"]
    assert "not written" in (tmp_path / "out" / "README.md").read_text()


def test_an_uncalibrated_drafter_exports_identity_temperatures(tmp_path):
    ddir = tmp_path / "d"
    tiny_drafter(tiny_target(), block_size=GAMMA).save_pretrained(ddir)
    write_engine_files(ddir, tmp_path / "out")
    sts = json.loads((tmp_path / "out" / "sglang" / "sts_calibration.json").read_text())
    assert sts["temperatures"] == [1.0] * GAMMA and not sts["provenance"]["calibrated"]
    assert "ece_before" not in sts  # no report describes these temperatures


# ----------------------------------------------------------------------------- CLI and pipeline
def test_cli_export_and_check(exported, tmp_path, capsys):
    assert main(["export", str(exported.drafter), str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "trtllm" / "sps_cost_table.json").is_file()
    sps = str(tmp_path / "cli" / "sglang" / "sps_table.json")
    assert main(["check", sps, "--drafter", str(exported.drafter), "--dtype", "float32",
                 "--device", "cpu"]) == 0
    other = tmp_path / "gamma3"
    tiny_drafter(exported.target, block_size=3).save_pretrained(other)
    capsys.readouterr()
    assert main(["check", sps, "--drafter", str(other)]) == 1
    assert "gamma: file 4, expected 3" in capsys.readouterr().err


def test_the_eval_stage_exports_beside_its_report(exported, tmp_path):
    from pipeline.model_stages import export_engine_files
    from pipeline.run_layout import RunLayout

    ctx = SimpleNamespace(run_dir=exported.root, cfg=SimpleNamespace(storage_options={}),
                          layout=RunLayout(exported.root),
                          drafter_location=lambda stage: str(exported.drafter))
    profile = json.loads((exported.drafter / "sps_profile.json").read_text())
    out = export_engine_files(ctx, profile, tmp_path / "eval" / "engine_files")
    assert len(out["written"]) == 4 and out["skipped"] == {}
    sts = json.loads((tmp_path / "eval" / "engine_files" / "sglang" / "sts_calibration.json")
                     .read_text())
    assert sts["ece_before"] == [0.05] * GAMMA  # from the calibrate stage's report
    profile["fingerprint"]["hidden_size"] = 1  # a mismatch is reported, the stage goes on
    out = export_engine_files(ctx, profile, tmp_path / "eval2")
    assert out["written"] == [] and "re-profile" in out["skipped"]["sts and sps"]
