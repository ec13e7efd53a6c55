"""backend: vllm builds a Ray Serve LLM application from the shipped serve_vllm.yaml (issue 13,
item 3): the exported drafter as vLLM's speculative_config (dspark, adaptive verification), one GPU
per replica, the config's autoscaling. Needs vLLM and Ray Serve: runs in .venv-interop."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("vllm", reason="runs in .venv-interop (bash infra/install.sh --interop)")
pytest.importorskip("ray.serve.llm")

from drafters.export import export  # noqa: E402
from serve.config import ServeConfig  # noqa: E402
from serve.vllm_app import build_vllm_app, llm_config  # noqa: E402
from tests.tiny import tiny_drafter, tiny_target  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_vllm_config_builds_an_openai_app(tmp_path):
    from ray.serve import Application

    target = tiny_target()
    target.save_pretrained(tmp_path / "target")
    drafter = tiny_drafter(target, layer_ids=(1, 3))
    drafter.config.target_name_or_path = str(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    export(tmp_path / "drafter", tmp_path / "export", "vllm", mask_token_id=95)
    args = yaml.safe_load((ROOT / "infra" / "configs" / "serve_vllm.yaml").read_text())[
        "applications"][0]["args"]
    cfg = ServeConfig.model_validate({**args, "vllm": {**args["vllm"],
                                                        "drafter_export": str(tmp_path / "export")}})
    llm = llm_config(cfg)
    spec = llm.engine_kwargs["speculative_config"]
    assert spec == {"model": str(tmp_path / "export"), "method": "dspark",
                    "num_speculative_tokens": 4, "enable_adaptive_verification": True}
    assert llm.engine_kwargs["tensor_parallel_size"] == 1
    assert llm.engine_kwargs["max_num_seqs"] == 64
    auto = llm.deployment_config["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"]) == (1, 8)
    assert isinstance(build_vllm_app(cfg), Application)
