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


def test_a_plot_belongs_to_the_run_with_the_longest_matching_name(tmp_path):
    """Labels extend each other (`_reference`, `_reference_greedy`): each plot is listed under
    its own run only."""
    from benchmarks.results_index import owner

    for stem in ("2026-12-03_avx2_reference", "2026-12-03_avx2_reference_greedy"):
        (tmp_path / f"{stem}.md").write_text("# r\n")
    plot = tmp_path / "2026-12-03_avx2_reference_greedy_tau.png"
    assert owner(plot) == "2026-12-03_avx2_reference_greedy"
    assert owner(tmp_path / "2026-12-03_avx2_reference_tau.png") == "2026-12-03_avx2_reference"
    assert owner(tmp_path / "2026-12-04_avx2_tau.png") is None


def test_a_merge_continues_the_newest_run_of_this_class(tmp_path, monkeypatch):
    monkeypatch.setattr(machine_mod, "RESULTS", tmp_path)
    folder = tmp_path / "fault_matrix"
    folder.mkdir()
    assert machine_mod.latest_stem("fault_matrix", m=AVX2) is None
    for name in ("2026-12-01_avx2", "2026-12-05_avx2", "2026-12-09_avx512-bf16",
                 "2026-12-07_avx2_other"):
        (folder / f"{name}.json").write_text("{}")
    assert machine_mod.latest_stem("fault_matrix", m=AVX2) == folder / "2026-12-05_avx2"
    assert machine_mod.latest_stem("fault_matrix", "other", m=AVX2) == folder / "2026-12-07_avx2_other"
