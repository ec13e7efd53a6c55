"""Where benchmark results go (issue 44.6): ``benchmarks/results/<script>/<date>_<machine
class>[_<label>]``, named by ``benchmarks/machine.py``'s ``result_stem``."""

from __future__ import annotations

import re

import pytest

from benchmarks import machine as machine_mod

AVX2 = {"device": "cpu", "cpu_capability": "AVX2", "native_bf16": False}
AVX512_BF16 = {"device": "cpu", "cpu_capability": "AVX512", "native_bf16": True}
H100 = {"device": "NVIDIA H100 80GB HBM3", "cpu_capability": "AVX512", "native_bf16": True}


def test_the_machine_class_names_what_changes_speed():
    assert machine_mod.machine_class(AVX2) == "avx2"
    assert machine_mod.machine_class(AVX512_BF16) == "avx512-bf16"
    assert machine_mod.machine_class(H100) == "nvidia-h100-80gb-hbm3"
    here = machine_mod.machine_class()  # this machine, whichever class it is
    assert re.fullmatch(r"[a-z0-9-]+", here)


def test_a_run_is_named_by_its_benchmark_date_class_and_label(tmp_path, monkeypatch):
    monkeypatch.setattr(machine_mod, "RESULTS", tmp_path)
    stem = machine_mod.result_stem("serve_load", "_first_slot", m=AVX2)
    assert stem.parent == tmp_path / "serve_load" and stem.parent.is_dir()
    assert re.fullmatch(r"20\d\d-\d\d-\d\d_avx2_first_slot", stem.name)
    assert machine_mod.result_stem("cache_io", m=AVX512_BF16).name.endswith("_avx512-bf16")
    assert not (tmp_path / "x").exists()
    machine_mod.result_stem("x", m=AVX2, make=False)
    assert not (tmp_path / "x").exists()  # a label check before any work makes no folder
    for bad in ("a/b", "a.b", "a b"):
        with pytest.raises(ValueError, match="letters, digits"):
            machine_mod.result_stem("x", bad, m=AVX2, make=False)


def test_every_result_file_names_its_date_and_machine_class():
    from benchmarks.results_index import INDEX, RESULTS

    named = re.compile(r"20\d\d-\d\d-\d\d_[a-z0-9-]+(_[A-Za-z0-9_-]+)?\.(md|json|png)")
    files = [p for p in RESULTS.rglob("*") if p.is_file() and p != INDEX]
    assert files and all(named.fullmatch(p.name) for p in files), [
        p.name for p in files if not named.fullmatch(p.name)]
