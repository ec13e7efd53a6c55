"""The container image and KubeRay manifests (infra/Dockerfile, infra/k8s/) point at what exists:
the entrypoint parses with pipeline/run.py's own parser and its config validates with the
manifest's overrides, the RayService's Serve config validates as this app's ServeConfig, every
file the image copies exists, and the versions match pyproject.toml's pins."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"


def _pins() -> dict[str, str]:
    text = (ROOT / "pyproject.toml").read_text()
    pins = dict(re.findall(r'"([a-z]+)(?:\[[^\]]*\])?==([0-9.]+)"', text))
    pins["version"] = re.search(r'^version = "([^"]+)"', text, re.M).group(1)
    return pins


def _containers(pod_spec: dict) -> list[dict]:
    return pod_spec["template"]["spec"]["containers"]


def _groups(cluster: dict) -> list[dict]:
    return [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]


def test_rayjob_entrypoint_parses_and_its_config_validates():
    from pipeline.config import load_config
    from pipeline.run import parse_args

    job = yaml.safe_load((K8S / "rayjob_pipeline.yaml").read_text())
    assert job["kind"] == "RayJob" and job["apiVersion"] == "ray.io/v1"
    env = {e["name"]: e.get("value") for e in _containers(job["spec"]["rayClusterSpec"]
                                                          ["headGroupSpec"])[0]["env"]}
    entry = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], job["spec"]["entrypoint"])
    argv = shlex.split(entry)
    assert argv[:2] == ["python", "pipeline/run.py"] and (ROOT / argv[1]).is_file()
    args = parse_args(argv[2:])
    assert (ROOT / args.config).is_file()
    cfg = load_config(str(ROOT / args.config), args.set)
    assert cfg.run_dir == env["RUN_DIR"] and cfg.cache.output.startswith("s3://")
    for path in (s.path for s in cfg.prompts.sources):
        assert (ROOT / path).exists(), path  # the datasets ship inside the image


def test_rayservice_serve_config_validates_as_this_apps_config():
    import importlib

    from ray.serve.schema import ServeDeploySchema

    from serve.config import ServeConfig

    svc = yaml.safe_load((K8S / "rayservice.yaml").read_text())
    assert svc["kind"] == "RayService"
    schema = ServeDeploySchema.model_validate(yaml.safe_load(svc["spec"]["serveConfigV2"]))
    (app,) = schema.applications
    module, func = app.import_path.split(":")
    assert callable(getattr(importlib.import_module(module), func))
    cfg = ServeConfig.model_validate(app.args)
    assert cfg.num_gpus >= 1 and cfg.torch_device() == "cuda"
    gpu_workers = [g for g in svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
                   if any("nvidia.com/gpu" in c["resources"]["limits"] for c in _containers(g))]
    assert gpu_workers, "the serve replicas reserve GPUs: some worker group must offer them"


def test_image_and_versions_match_the_repository():
    pins = _pins()
    docker = (ROOT / "infra" / "Dockerfile").read_text()
    for src in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", docker, re.M):
        for part in src.split():
            assert (ROOT / part).exists(), part
    assert f"rayproject/ray:{pins['ray']}-" in docker
    assert f"torch=={pins['torch']}" in docker and f"deepspeed=={pins['deepspeed']}" in docker
    for name in ("rayjob_pipeline.yaml", "rayservice.yaml"):
        spec = yaml.safe_load((K8S / name).read_text())["spec"]
        cluster = spec.get("rayClusterSpec") or spec["rayClusterConfig"]
        assert cluster["rayVersion"] == pins["ray"]
        images = {c["image"] for g in _groups(cluster) for c in _containers(g)}
        assert images == {f"REGISTRY/dspark-ray:{pins['version']}"}, images
