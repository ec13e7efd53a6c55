"""Log hygiene (issue 24, item 6): the project's Ray calls use no deprecated argument, and the
worker hook of the pipeline's local Ray drops exactly the placement-group cleaner's State API noise
(pipeline/ray_logs.py). No Ray runs here; tests/integration/test_ray_log_hygiene.py runs the Ray
Data calls."""

from __future__ import annotations

import ast
import importlib
import logging
import threading
from pathlib import Path

import pytest

from pipeline import ray_logs

ROOT = Path(__file__).resolve().parents[2]
# Ray Data transforms whose ``concurrency`` argument Ray 2.51 deprecated for ``compute``
TRANSFORMS = {"map", "map_batches", "flat_map", "filter", "map_groups", "add_column", "with_column"}


def _project_sources():
    for package in ("pipeline", "serve", "benchmarks", "infra"):
        yield from sorted((ROOT / package).rglob("*.py"))


def deprecated_ray_arguments(source: str) -> list[str]:
    """Deprecated Ray arguments in a module's source: ``concurrency=`` of a Ray Data transform
    (Ray 2.51: use ``compute``), ``ray_remote_args=`` (removed in Ray 2.64: use the named remote
    parameters) and ``local://`` paths (removed after January 2027)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            for kw in node.keywords:
                if kw.arg == "concurrency" and name in TRANSFORMS:
                    found.append(f"line {node.lineno}: {name}(concurrency=...)")
                if kw.arg == "ray_remote_args":
                    found.append(f"line {node.lineno}: {name}(ray_remote_args=...)")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.startswith("local://"):  # an f-string's leading part included
            found.append(f"line {node.lineno}: a local:// path")
    return found


def test_the_checker_finds_each_deprecated_form():
    source = ('ds.map_batches(F, concurrency=2)\nray.data.read_text(p, ray_remote_args={})\n'
              'ray.data.read_text(f"local://{p}")\nds.map_batches(F, compute=c)\n')
    assert deprecated_ray_arguments(source) == [
        "line 1: map_batches(concurrency=...)", "line 2: read_text(ray_remote_args=...)",
        "line 3: a local:// path"]


def test_no_deprecated_ray_arguments_in_the_project():
    found = {str(p.relative_to(ROOT)): f for p in _project_sources()
             if (f := deprecated_ray_arguments(p.read_text()))}
    assert not found, found


@pytest.fixture
def cleaner_log():
    """Records reaching a handler on the cleaner's logger, with the hook's filter installed (the
    logger's filters are restored afterwards)."""
    logger = logging.getLogger(ray_logs.PG_CLEANER_LOGGER)
    filters, level = list(logger.filters), logger.level
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    ray_logs.install_filter()
    ray_logs.install_filter()  # idempotent
    yield logger, records
    logger.removeHandler(handler)
    logger.filters[:] = filters
    logger.setLevel(level)


def test_the_filter_drops_only_the_state_api_warning(cleaner_log):
    logger, records = cleaner_log
    assert sum(isinstance(f, ray_logs.DropMessage) for f in logger.filters) == 1
    # the message exactly as ray/train/v2/_internal/execution/controller/placement_group_cleaner.py
    # logs it
    logger.warning("Failed to query Ray Train Controller actor state. "
                   "State API may be temporarily unavailable. Continuing to monitor.")
    logger.warning("Detected that the Ray Train controller actor (%s) is dead.", "abc")
    logger.warning("Failed to query placement group table: boom.")
    assert records == ["Detected that the Ray Train controller actor (abc) is dead.",
                       "Failed to query placement group table: boom."]
    # other loggers are untouched
    assert not any(isinstance(f, ray_logs.DropMessage)
                   for f in logging.getLogger("ray.train").filters)


def _thread_failure(name: str, exc: BaseException) -> list:
    """Run a thread named ``name`` that raises ``exc`` under the hook; return what reached the
    previous ``threading.excepthook``."""
    seen = []
    before = threading.excepthook
    threading.excepthook = lambda args: seen.append((args.thread.name, args.exc_type))
    try:
        ray_logs.install_thread_hook()
        ray_logs.install_thread_hook()  # idempotent: one wrapper

        def boom():
            raise exc

        t = threading.Thread(target=boom, name=name)
        t.start()
        t.join()
    finally:
        threading.excepthook = before
    return seen


def test_the_thread_hook_silences_only_the_cleaners_multi_cluster_lookup():
    multi = ConnectionError("Found multiple active Ray instances: {'a:1', 'b:2'}. Please specify "
                            "the one to connect to by setting the `--address` flag")
    assert _thread_failure(ray_logs.PG_CLEANER_THREAD, multi) == []
    assert _thread_failure(ray_logs.PG_CLEANER_THREAD, ConnectionError("refused")) == [
        (ray_logs.PG_CLEANER_THREAD, ConnectionError)]
    assert _thread_failure(ray_logs.PG_CLEANER_THREAD, ValueError("x")) == [
        (ray_logs.PG_CLEANER_THREAD, ValueError)]
    assert _thread_failure("other", multi) == [("other", ConnectionError)]


def test_the_runtime_env_names_the_hook_and_the_hook_never_raises(monkeypatch):
    module, _, name = ray_logs.LOCAL_RUNTIME_ENV["worker_process_setup_hook"].rpartition(".")
    assert getattr(importlib.import_module(module), name) is ray_logs.quiet_local_worker

    def fail():
        raise RuntimeError("broken")

    monkeypatch.setattr(ray_logs, "install_filter", fail)
    monkeypatch.setattr(ray_logs, "install_thread_hook", fail)
    ray_logs.quiet_local_worker()  # a raising setup hook would end every Ray worker
