"""``infra/gpu_check.sh`` (issue 41): refuses clearly without CUDA, and its checks run (on the CPU
here, tiny) so the script a GPU session runs is not broken when it gets there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "infra"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_cuda_it_refuses_with_the_reason():
    done = subprocess.run(["bash", str(ROOT / "infra" / "gpu_check.sh")], capture_output=True,
                          text=True, timeout=120, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2
    assert "no CUDA device is visible" in done.stderr and "CUDA build" in done.stderr


def test_its_checks_pass_on_the_cpu(smollm2_dir):
    import gpu_check
    from serve.engine.target_loading import load_tokenizer

    target = str(smollm2_dir)
    ids = gpu_check.prompts(load_tokenizer(target), 2)
    lossless = gpu_check.check_lossless(target, "cpu", ids[:1], 8)
    assert lossless == {"identical": 1, "of": 1, "first_difference": [None]}
    step = gpu_check.check_training_step(target, "cpu", ids)
    assert step["finite"] and step["parameters_moved"] == step["of"] > 0
