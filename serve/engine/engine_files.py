"""Engine files that travel with a drafter: the fitted STS temperatures and the profiled SPS(B)
table in SGLang's and TensorRT-LLM's formats, each with the model and hardware it was measured on.

    python -m serve.engine.engine_files export DRAFTER_DIR DST [--sps-profile FILE] [--report FILE]
    python -m serve.engine.engine_files check FILE --drafter DRAFTER_DIR [--dtype bfloat16] [--device cpu]

``DST`` gets ``sglang/{sts_calibration,sps_table}.json``, ``trtllm/{sts_calibration,
sps_cost_table}.json`` and a README naming the flags. The formats were read from the engines'
loaders (field names, units, indexing); nothing here imports them:

- SGLang (sgl-project/sglang ``python/sglang/srt/speculative/dspark_components/``):
  ``--speculative-dspark-confidence-sts-path`` -> ``dspark_sts.py`` ``DSparkStsCalibration``
  (msgspec: ``temperatures`` [block_size] > 0, optional ``dataset``, ``num_samples``,
  ``ece_before``, ``ece_after``; unknown keys ignored); ``dspark_planner.py`` refuses a vector whose
  length is not the runtime block size (draft positions 1..block_size, the anchor has none) and
  applies ``sigmoid(z_k / T_k)``. ``--speculative-dspark-sps-table-path`` -> ``dspark_sps.py``
  ``SpsCostTable``: ``sample_batch_tokens`` (int, strictly increasing, >= 1),
  ``sample_steps_per_sec`` (steps/s), ``max_batch_tokens``; floor lookup at ``batch_tokens =
  requests + verified drafts``, i.e. every token of the target's verification pass, anchors
  included (``benchmark/dspark_sps_profiler.py``: requests x (block_size + 1) in a full step).
- TensorRT-LLM (NVIDIA/TensorRT-LLM ``tensorrt_llm/_torch/speculative/``): ``DSparkDecodingConfig``
  ``confidence_sts_path`` -> ``dspark_sts.py`` reads ``sts_temperatures`` (or SGLang's
  ``temperatures``); ``confidence_sps_table_path`` -> ``dspark_planner.py`` ``SpsCostTable``:
  ``token_counts`` (total verified tokens, bonus/anchor included, strictly increasing),
  ``step_time_ms`` (milliseconds per step, > 0), optional ``fixed_overhead_ms``,
  ``batch_sizes`` / ``batch_overhead_ms``; linear interpolation. ``dspark.py`` warns unless
  ``_meta.lookup == "interp"`` and refuses a table whose ``_meta.engine`` disagrees with the live
  engine on a shared key (``tp``, ``ep``, ``attention_dp``, ``block`` = block_size,
  ``max_batch_size``). Not representable: the newest stored planner accepts only ``schema_version
  2`` tables sealed with a fingerprint of a live TensorRT-LLM engine (GPU snapshot, source head,
  CUDA-graph sizes), which only TensorRT-LLM's own profiler can write; and one stored
  ``llm_args.py`` has no confidence fields at all. ``confidence_calibration_path`` /
  ``confidence_cost_table_path`` were not found upstream.

What the SPS files hold: this project's SPS(B) (``serve/engine/profiling.py``), the target's batched
verification pass alone, written for every B = 1..max_tokens (interpolated between measured
sizes exactly as this engine does), so both engines' lookups reproduce it. The drafter's own cost
(``draft_cost_profile.json``) is not in them. Every file carries ``provenance``; this project's
loader (:func:`load_engine_file`) refuses one measured for another model, block size, device or
dtype. The provenance records the draft length under its published key ``gamma`` (with
``verify_tokens_per_request`` = it + 1).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from drafters.base import WEIGHTS_NAME
from drafters.config import read_drafter_config

from .profiling import PROFILE_NAME, device_name
from .scheduler import SPSTable

ENGINES = ("sglang", "trtllm")
FILE_NAMES = {("sglang", "sts"): "sglang/sts_calibration.json",
              ("sglang", "sps"): "sglang/sps_table.json",
              ("trtllm", "sts"): "trtllm/sts_calibration.json",
              ("trtllm", "sps"): "trtllm/sps_cost_table.json"}
FORMAT_VERSION = 1
# keys TensorRT-LLM's loader reads as "exact schema-v2 table": never written at the top level
TRTLLM_V2_MARKERS = ("cost_tables", "engine_fingerprint", "engine_fingerprint_sha256",
                     "measurements", "schema_version")


class EngineFileError(ValueError):
    """A malformed engine file, or one that cannot be written (the reason is named)."""


class EngineFileMismatch(EngineFileError):
    """An engine file measured for another model, block size, device or dtype than it is loaded
    for."""


# ----------------------------------------------------------------------------- facts
def _model_id(name: str) -> str:
    """What two spellings of one model share: the last path component (``Qwen/Qwen3-4B`` and
    ``/models/Qwen3-4B`` are both ``Qwen3-4B``)."""
    return Path(str(name).rstrip("/")).name


def drafter_facts(drafter_dir: str | Path) -> dict:
    """Target, block_size, confidence head, temperatures and weights hash of a drafter directory."""
    cfg = read_drafter_config(drafter_dir)
    digest = hashlib.sha256()
    with open(Path(drafter_dir) / WEIGHTS_NAME, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    return {"target_model": cfg.target_name_or_path, "target_hidden_size": cfg.target_hidden_size,
            "target_vocab_size": cfg.target_vocab_size, "drafter_path": str(drafter_dir),
            "drafter_type": cfg.drafter_type, "drafter_weights_sha256": digest.hexdigest(),
            "block_size": cfg.block_size, "confidence_head": bool(cfg.confidence_head),
            "temperatures": cfg.calibration_temperatures}


def _provenance(facts: dict, kind: str, engine: str, num_speculative_tokens: int,
                **extra) -> dict:
    """The ``provenance`` block of a file for ``num_speculative_tokens`` draft tokens per round
    (an STS file: the drafter's block_size; an SPS file: the profile's block_tokens - 1), written
    under the published key ``gamma``."""
    return {"producer": "dspark-ray", "format_version": FORMAT_VERSION, "kind": kind,
            "engine": engine, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **{k: facts[k] for k in ("target_model", "target_hidden_size", "target_vocab_size",
                                     "drafter_path", "drafter_type", "drafter_weights_sha256")},
            "gamma": num_speculative_tokens,
            "verify_tokens_per_request": num_speculative_tokens + 1, **extra}


# ----------------------------------------------------------------------------- writers
def sts_payloads(facts: dict, report: dict | None = None) -> dict[str, dict]:
    """SGLang's and TensorRT-LLM's STS files for the drafter ``facts`` (:func:`drafter_facts`).

    ``report`` is the calibrate stage's ``report.json``: its report-half ECE per position goes into
    SGLang's ``ece_before`` / ``ece_after`` when it describes the drafter's temperatures.
    Raises:
        EngineFileError: the drafter has no confidence head (nothing to calibrate).
    """
    if not facts["confidence_head"]:
        raise EngineFileError("the drafter has no confidence head: no STS temperatures")
    block_size = facts["block_size"]
    temps = [float(t) for t in (facts["temperatures"] or [1.0] * block_size)]
    report = report or {}
    fitted = report.get("calibrated") and report.get("temperatures") == temps
    prov = _provenance(facts, "sts", "", block_size,
                       calibrated=facts["temperatures"] is not None,
                       dtype=report.get("dtype"), device=report.get("device"),
                       positions="T_k for draft positions k = 1..gamma (the anchor has none); "
                       "calibrated confidence = sigmoid(z_k / T_k)")
    sglang = {"temperatures": temps, "dataset": "", "num_samples": 0}
    if fitted:
        rows = report["report"]["positions"]
        sglang.update(dataset="dspark-ray calibrate stage: held-out prompts (fit half; ECE on "
                      "the other half, 20 bins, prefix survival)",
                      num_samples=int(report.get("fit_rounds", 0)),
                      ece_before=[float(r["ece_before"]) for r in rows],
                      ece_after=[float(r["ece_after"]) for r in rows])
    return {"sglang": {**sglang, "provenance": {**prov, "engine": "sglang"}},
            "trtllm": {"sts_temperatures": temps, "provenance": {**prov, "engine": "trtllm"}}}


def sps_payloads(facts: dict, profile: dict) -> dict[str, dict]:
    """SGLang's and TensorRT-LLM's SPS files from a stored ``sps_profile.json`` payload.

    Raises:
        EngineFileMismatch: the profile was measured for another target than the drafter's.
        ValueError: a malformed profile.
    """
    fp = profile["fingerprint"]
    if (_model_id(fp["model"]) != _model_id(facts["target_model"])
            or fp["hidden_size"] != facts["target_hidden_size"]):
        raise EngineFileMismatch(
            f"the SPS profile was measured for target {fp['model']!r} (hidden size "
            f"{fp['hidden_size']}), the drafter serves {facts['target_model']!r} (hidden size "
            f"{facts['target_hidden_size']}): re-profile with this drafter's target")
    table = SPSTable.from_dict(profile["table"])
    num_speculative_tokens = int(profile.get("block_tokens") or facts["block_size"] + 1) - 1
    dtype = str(fp["dtype"]).removeprefix("torch.")
    hardware = {k: fp[k] for k in ("device", "device_type", "cpu_count", "torch_threads", "torch")
                if k in fp}
    prov = _provenance(facts, "sps", "", num_speculative_tokens, hardware=hardware, dtype=dtype,
                       profiled_model=fp["model"], measured_at=profile.get("measured_at"),
                       measured_batch_tokens=sorted(int(b) for b in profile.get("measured", {})),
                       covers="the target's batched verification pass only (B tokens, anchors "
                       "included, requests of gamma + 1 tokens); the drafter's cost is not in it")
    batch = list(range(1, table.max_tokens + 1))
    sglang = {"sample_batch_tokens": batch, "sample_steps_per_sec": list(table.sps_by_batch),
              "max_batch_tokens": table.max_tokens, "provenance": {**prov, "engine": "sglang",
                                                                   "units": "steps per second"}}
    trtllm = {"token_counts": batch, "step_time_ms": [1000.0 / s for s in table.sps_by_batch],
              "fixed_overhead_ms": 0.0,
              "_meta": {"lookup": "interp",
                        "engine": {"tp": 1, "block": num_speculative_tokens,
                                   "device": hardware.get("device"),
                                   "dtype": dtype, "model": facts["target_model"],
                                   "producer": "dspark-ray"}},
              "provenance": {**prov, "engine": "trtllm", "units": "milliseconds per step"}}
    return {"sglang": sglang, "trtllm": trtllm}


def _readme(written: dict[str, str], skipped: dict[str, str], facts: dict) -> str:
    g = facts["block_size"]
    lines = [f"# Engine files for the drafter at {facts['drafter_path']}", "",
             f"Target {facts['target_model']}, block size {g} (verify window {g + 1}); written by "
             "`python -m serve.engine.engine_files` (dspark-ray). Each file's `provenance` says what it "
             "was measured on; `python -m serve.engine.engine_files check FILE --drafter DIR` refuses a "
             "file measured for another model, block size, device or dtype.", ""]
    lines += [f"- `{name}`" for name in sorted(written)]
    lines += [f"- not written: {name}: {why}" for name, why in sorted(skipped.items())]
    lines += ["", "SGLang:", "", "```",
              f"--speculative-algorithm DSPARK --speculative-dspark-block-size {g} \\",
              "  --speculative-dspark-confidence-sts-path sglang/sts_calibration.json \\",
              "  --speculative-dspark-sps-table-path sglang/sps_table.json", "```", "",
              "TensorRT-LLM (DSpark builds whose `DSparkDecodingConfig` has the confidence "
              "fields):", "", "```yaml", "speculative_config:", "  decoding_type: DSpark",
              f"  max_draft_len: {g}", "  enable_confidence_scheduling: true",
              "  confidence_sts_path: trtllm/sts_calibration.json",
              "  confidence_sps_table_path: trtllm/sps_cost_table.json", "```", "",
              "The SPS tables time the target's verification pass on the hardware in their "
              "provenance, not the drafter; re-profile on the serving hardware for real use.", ""]
    return "\n".join(lines)


def write_engine_files(drafter_dir: str | Path, dst: str | Path, *,
                       sps_profile: dict | str | Path | None = None,
                       calibration_report: dict | str | Path | None = None) -> dict:
    """Write the STS and SPS files of the drafter at ``drafter_dir`` for both engines to ``dst``.

    Args:
        sps_profile: the stored SPS profile (payload or path); default
            ``drafter_dir/sps_profile.json`` (written when an engine first served the drafter).
        calibration_report: the calibrate stage's ``report.json`` (payload or path); default
            ``drafter_dir/../report.json`` when it is one.
    Returns:
        ``{"dst", "written": [relative paths], "skipped": {"sts"|"sps": reason}}``.
    Raises:
        EngineFileMismatch: the SPS profile belongs to another target.
    """
    dst = Path(dst)
    facts = drafter_facts(drafter_dir)
    profile = _read_json(sps_profile if sps_profile is not None
                         else Path(drafter_dir) / PROFILE_NAME)
    report = _read_json(calibration_report if calibration_report is not None
                        else Path(drafter_dir).parent / "report.json")
    payloads, skipped = {}, {}
    try:
        payloads["sts"] = sts_payloads(facts, report if report and "calibrated" in report else None)
    except EngineFileError as err:
        skipped["sts"] = str(err)
    if profile is None:
        skipped["sps"] = (f"no {PROFILE_NAME}: serve or evaluate the drafter with scheduler "
                          "dspark or async (sps_profile: auto) first, or pass --sps-profile")
    else:
        payloads["sps"] = sps_payloads(facts, profile)
    written = {}
    for kind, by_engine in payloads.items():
        for engine, payload in by_engine.items():
            name = FILE_NAMES[(engine, kind)]
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            (dst / name).write_text(json.dumps(payload, indent=1) + "\n")
            written[name] = engine
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "README.md").write_text(_readme(written, skipped, facts))
    return {"dst": str(dst), "written": sorted(written), "skipped": skipped}


def _read_json(source: dict | str | Path | None) -> dict | None:
    if source is None or isinstance(source, dict):
        return source
    path = Path(source)
    return json.loads(path.read_text()) if path.is_file() else None


# ----------------------------------------------------------------------------- loader
@dataclass(frozen=True)
class EngineFile:
    """A parsed engine file: ``kind`` "sts" (``temperatures``) or "sps" (``sps``)."""

    kind: str
    engine: str
    provenance: dict
    temperatures: tuple[float, ...] | None = None
    sps: SPSTable | None = None


def _numbers(payload: dict, key: str, integer: bool = False) -> list:
    values = payload.get(key)
    kind = int if integer else (int, float)
    if (not isinstance(values, list) or not values
            or any(isinstance(v, bool) or not isinstance(v, kind) for v in values)):
        raise EngineFileError(f"{key!r} must be a non-empty list of "
                              f"{'integers' if integer else 'numbers'}")
    if not integer and any(not (math.isfinite(v) and v > 0) for v in values):
        raise EngineFileError(f"{key!r} values must be finite and > 0, got {values}")
    return values


def _increasing(xs: list[int], key: str) -> None:
    if xs[0] < 1 or any(b <= a for a, b in zip(xs, xs[1:])):
        raise EngineFileError(f"{key!r} must be strictly increasing batch sizes >= 1, got {xs}")


def read_engine_file(path: str | Path) -> EngineFile:
    """Parse and validate one engine file of either engine (no provenance check).

    Raises:
        EngineFileError: not JSON, no known layout, or values the engine would refuse.
    """
    try:
        p = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise EngineFileError(f"{path}: not a readable JSON file: {err}") from err
    if not isinstance(p, dict):
        raise EngineFileError(f"{path}: not a JSON object")
    prov = p.get("provenance") if isinstance(p.get("provenance"), dict) else {}
    try:
        if "sts_temperatures" in p or "temperatures" in p:
            engine = "trtllm" if "sts_temperatures" in p else "sglang"
            temps = _numbers(p, "sts_temperatures" if engine == "trtllm" else "temperatures")
            return EngineFile("sts", engine, prov, temperatures=tuple(map(float, temps)))
        if "sample_batch_tokens" in p:
            xs, ys = _numbers(p, "sample_batch_tokens", True), _numbers(p, "sample_steps_per_sec")
            _increasing(xs, "sample_batch_tokens")
            top = p.get("max_batch_tokens")
            if len(xs) != len(ys) or not isinstance(top, int) or top < xs[-1]:
                raise EngineFileError("sample_batch_tokens / sample_steps_per_sec lengths differ "
                                      "or max_batch_tokens is below the largest sample")
            # SGLang's lookup: the value at the largest sample <= B (the first below it)
            grid = [ys[max(0, sum(x <= b for x in xs) - 1)] for b in range(1, top + 1)]
            return EngineFile("sps", "sglang", prov, sps=SPSTable(tuple(grid)))
        if "token_counts" in p:
            if set(TRTLLM_V2_MARKERS) & set(p):
                raise EngineFileError("a TensorRT-LLM schema-v2 (exact, engine-sealed) table: "
                                      "not a table this project measures")
            xs, ms = _numbers(p, "token_counts", True), _numbers(p, "step_time_ms")
            _increasing(xs, "token_counts")
            if len(xs) != len(ms):
                raise EngineFileError("token_counts and step_time_ms lengths differ")
            extra = float(p.get("fixed_overhead_ms", 0.0))
            grid = [1000.0 / (_interp(b, xs, ms) + extra) for b in range(1, xs[-1] + 1)]
            return EngineFile("sps", "trtllm", prov, sps=SPSTable(tuple(grid)))
    except (TypeError, ValueError) as err:
        raise EngineFileError(f"{path}: {err}") from err
    raise EngineFileError(f"{path}: neither an STS file (temperatures / sts_temperatures) nor an "
                          "SPS table (sample_batch_tokens / token_counts)")


def _interp(x: float, xs: list[int], ys: list[float]) -> float:
    """Clamped linear interpolation (numpy.interp's rule, as TensorRT-LLM looks tables up)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = next(i for i in range(1, len(xs)) if xs[i] >= x)
    return ys[i - 1] + (x - xs[i - 1]) / (xs[i] - xs[i - 1]) * (ys[i] - ys[i - 1])


def load_engine_file(path: str | Path, *, target_model: str | None = None,
                     block_size: int | None = None, hardware: dict | None = None,
                     dtype: str | None = None, drafter_sha256: str | None = None) -> EngineFile:
    """Read an engine file and refuse it unless its provenance matches what it is loaded for.

    Args:
        target_model: compared by last path component (:func:`_model_id`).
        block_size: the drafter's block_size: the file's provenance ``gamma`` must equal it (an
            STS file also holds one temperature per draft position).
        hardware: e.g. ``{"device": ..., "device_type": "cuda"}``; SPS files only, keys the file
            also records are compared.
        dtype: the serving dtype ("bfloat16"); SPS files only.
        drafter_sha256: the drafter's weights hash; STS files only (temperatures belong to one
            confidence head).
    Raises:
        EngineFileError: malformed, or no dspark-ray provenance to check.
        EngineFileMismatch: a provenance field differs (each named with both values).
    """
    f = read_engine_file(path)
    prov = f.provenance
    if prov.get("producer") != "dspark-ray" or prov.get("kind") != f.kind:
        raise EngineFileError(f"{path}: no dspark-ray provenance, so what it was measured on "
                              "cannot be checked; refusing it")
    wrong = []
    if (target_model is not None
            and _model_id(prov.get("target_model", "")) != _model_id(target_model)):
        wrong.append(f"target model: file {prov.get('target_model')!r}, expected {target_model!r}")
    if block_size is not None and prov.get("gamma") != block_size:
        wrong.append(f"gamma: file {prov.get('gamma')}, expected {block_size}")
    if f.kind == "sts":
        if len(f.temperatures) != prov.get("gamma"):
            wrong.append(f"{len(f.temperatures)} temperatures for gamma {prov.get('gamma')}")
        if drafter_sha256 is not None and prov.get("drafter_weights_sha256") != drafter_sha256:
            wrong.append("drafter: fitted for weights sha256 "
                         f"{str(prov.get('drafter_weights_sha256'))[:12]}..., these are "
                         f"{drafter_sha256[:12]}...")
    else:
        recorded = prov.get("hardware") or {}
        if hardware is not None and "device" not in recorded:
            wrong.append("hardware: the file records no device")
        for key in sorted(set(hardware or {}) & set(recorded)):
            if str(recorded[key]) != str(hardware[key]):
                wrong.append(f"hardware {key}: file {recorded[key]!r}, here {hardware[key]!r}")
        if dtype is not None and prov.get("dtype") != dtype.removeprefix("torch."):
            wrong.append(f"dtype: file {prov.get('dtype')!r}, expected {dtype!r}")
    if wrong:
        raise EngineFileMismatch(f"{path} was measured for something else: " + "; ".join(wrong))
    return f


# ----------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve.engine.engine_files",
                                     description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write the SGLang and TensorRT-LLM files")
    ex.add_argument("drafter", help="dspark-ray drafter directory")
    ex.add_argument("dst", help="output directory")
    ex.add_argument("--sps-profile", help=f"default: DRAFTER/{PROFILE_NAME}")
    ex.add_argument("--report", help="calibrate report.json (default: DRAFTER/../report.json)")
    ck = sub.add_parser("check", help="load a file as this project does; refuse a mismatch")
    ck.add_argument("file")
    ck.add_argument("--drafter", required=True, help="the drafter it is meant for")
    ck.add_argument("--dtype", help="serving dtype (SPS files)")
    ck.add_argument("--device", choices=("cpu", "cuda"), help="this machine's device (SPS files)")
    args = parser.parse_args(argv)
    try:
        if args.command == "export":
            out = write_engine_files(args.drafter, args.dst, sps_profile=args.sps_profile,
                                     calibration_report=args.report)
        else:
            hardware = None
            if args.device:
                import torch

                hardware = {"device": device_name(torch.device(args.device)),
                            "device_type": args.device}
            facts = drafter_facts(args.drafter)
            f = load_engine_file(args.file, target_model=facts["target_model"],
                                 block_size=facts["block_size"], hardware=hardware,
                                 dtype=args.dtype,
                                 drafter_sha256=facts["drafter_weights_sha256"])
            out = {"file": args.file, "kind": f.kind, "engine": f.engine, "ok": True}
    except (EngineFileError, FileNotFoundError, ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
