"""The README's test command runs on 2 pytest-xdist workers (``-n 2``); every test module that
starts a Ray cluster must belong to one of the two Ray work units whose tests run in turn
(tests/conftest.py), since several local clusters starting at once time out each other's
start-up."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import (OWN_CLUSTERS, RAY_MODULE_SIGNS, SHARED_CLUSTER, ray_modules,
                            xdist_scope)

ROOT = Path(__file__).resolve().parents[2]

# what starts a cluster: the pipeline as a user runs it, ray.init, Ray Serve, a multi-node
# cluster, and Ray Data (which starts one on first use), directly or through the stages' passes
STARTS_RAY = re.compile(r'"run\.py"|"pipeline\.run"|\brun_pipeline\(|\bray\.init\(|\bserve\.run\('
                        r'|cluster_utils|\bray\.data\.(read|from)_\w+\(|\brun_generate\('
                        r'|\brun_cache(_split)?\(|\bscan_split\(|\bpack_shards\(')
# modules the pattern matches that start nothing (why)
STARTS_NOTHING = {
    "tests/unit/test_ray_log_hygiene.py": "checks the project's source text for deprecated calls",
}


def test_every_module_that_starts_ray_says_so():
    unmarked = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.parent.name == "interop":  # its own interpreter and command, one process
            continue
        text = path.read_text()
        module = str(path.relative_to(ROOT))
        if (STARTS_RAY.search(text) and not any(sign in text for sign in RAY_MODULE_SIGNS)
                and module not in STARTS_NOTHING):
            unmarked.append(module)
    assert unmarked == [], f"mark these pytest.mark.ray: {unmarked}"


def test_the_guard_sees_a_pipeline_run_and_not_a_stand_in():
    assert STARTS_RAY.search('subprocess.run([sys.executable, str(ROOT / "pipeline" / "run.py")])')
    assert STARTS_RAY.search("counts = run_generate({'train': (rows, out)}, errors, cfg)")
    assert not STARTS_RAY.search('monkeypatch.setattr(ray, "init", lambda *a, **k: None)')
    assert not STARTS_RAY.search("ctx = ray.data.DataContext()")


def test_ray_modules_form_two_work_units_and_the_others_are_spread():
    """The shared-cluster modules in one unit, the modules starting their own clusters in the
    other (so no two clusters of either kind start at once), every other test alone."""
    modules = ray_modules(str(ROOT))
    assert modules["tests/integration/test_train_ray.py"] == SHARED_CLUSTER  # ray_local
    assert modules["tests/integration/test_feature_stream.py"] == SHARED_CLUSTER
    assert modules["tests/integration/test_pipeline_e2e.py"] == OWN_CLUSTERS  # run.py subprocesses
    assert modules["tests/integration/test_multinode.py"] == OWN_CLUSTERS  # cluster_utils
    assert "tests/unit/test_scheduler.py" not in modules
    assert "tests/unit/test_generate_engine.py" not in modules  # its Ray tests moved out
    own = "tests/integration/test_pipeline_e2e.py::test_end_to_end_smoke_and_rerun"
    shared = ("tests/integration/test_feature_stream.py::test_one_epoch_of_the_online_stream_"
              "holds_every_sample_once")
    assert xdist_scope(own, str(ROOT)) == OWN_CLUSTERS
    assert xdist_scope(shared, str(ROOT)) == SHARED_CLUSTER
    other = "tests/unit/test_scheduler.py::test_random_instances_exactly_lossless"
    assert xdist_scope(other, str(ROOT)) == other
