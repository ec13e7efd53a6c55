"""`pipeline/run.py` on target families other than Llama / Qwen3 (issue 40): every stage
(prompts, generate, cache, train, calibrate, eval), a release and an export, as a user runs them,
on a tiny random target of each family saved with ``save_pretrained`` (tests/families.py).

Two families by default (each run costs ~90 s and ~150 CPU-seconds on a 2-core machine, nearly
all of it Ray's and DeepSpeed's start-ups): Phi-3
(fused projections, ``drafter.init: target_layers``, a sliding last layer the drafter mirrors into
its release and export) and Qwen3-Next (hybrid linear attention), both with the engine backend.
Qwen3 runs in test_pipeline_e2e.py (with the hf backend). What differs on the other families is checked without Ray, on
every family of tests/families.py: the engine's losslessness (tests/unit/test_target_families.py,
which also maps ``init: target_layers``), the windows a drafter mirrors and exports
(tests/unit/test_drafter_window.py, test_export.py). ``DSPARK_TEST_ALL_FAMILIES=1`` adds Gemma 3
(sliding and full layers, GeGLU, scaled embeddings; the hf generate backend), gpt-oss (attention
sinks, MoE), Llama, Mistral, Qwen2 (sliding above ``max_window_layers``) and Qwen3-MoE (about
eight minutes more)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from drafters.export import main as export_main
from tests.families import WINDOW, family_target_dir

from .pipeline_config import ROOT, tiny_pipeline_config

pytestmark = [pytest.mark.slow, pytest.mark.ray]

CASES = {  # family -> config overrides
    "phi3": {"generate": {"backend": "engine"}, "drafter": {"init": "target_layers"}},
    "qwen3-next": {"generate": {"backend": "engine"}},
}

if os.environ.get("DSPARK_TEST_ALL_FAMILIES") == "1":
    CASES.update({
        "gemma3": {"generate": {"backend": "hf"}},
        "gpt-oss": {"generate": {"backend": "engine"}},
        "llama": {"generate": {"backend": "hf"}, "drafter": {"init": "target_layers"}},
        "mistral": {"generate": {"backend": "engine"}, "drafter": {"init": "target_layers"}},
        "qwen2-sliding": {"generate": {"backend": "engine"}},
        "qwen3-moe": {"generate": {"backend": "hf"}},
    })

# families whose last decoder layer slides: the window a 1-layer drafter bound to them gets
FAMILY_WINDOWS = {"mistral": WINDOW, "phi3": WINDOW, "qwen2-sliding": WINDOW}


@pytest.mark.parametrize("family", sorted(CASES))
def test_every_stage_release_and_export_on_the_family(tmp_path, smollm2_dir, family):
    target = family_target_dir(family, smollm2_dir, tmp_path / "target")
    config = tiny_pipeline_config(tmp_path, target, n_prompts=8)
    cfg = yaml.safe_load(config.read_text())
    for section, values in CASES[family].items():
        cfg[section].update(values)
    cfg["train"].update(num_epochs=1, num_workers=1, global_batch_size=1)
    # what the export needs: vLLM's DSpark layers are Qwen3-shaped, and vLLM reads a layer's
    # features before the final norm (so not the last of these 4 layers)
    cfg["drafter"]["qk_norm"] = True
    cfg["target"]["layer_ids"] = [1, 2]
    config.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, str(ROOT / "pipeline" / "run.py"), "--config",
                           str(config), "--release", str(tmp_path / "release")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    for stage in ("prompts", "generate", "cache", "train", "calibrate", "eval"):
        assert (run / stage / "_SUCCESS.json").exists(), stage
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["results"], "the eval stage reported nothing"
    assert (tmp_path / "release" / "model.safetensors").exists()
    # the main() that `python -m drafters.export` runs, called in this process: a second
    # interpreter importing torch and transformers cost ~5 s a family
    assert export_main(["--format", "speculators", str(tmp_path / "release"),
                        str(tmp_path / "export")]) == 0
    exported_cfg = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported_cfg["speculators_model_type"]
    # the drafter (1 layer) mirrors the target's last layer: sliding on Mistral, Phi-3 and Qwen2
    # above max_window_layers, full on the others (Gemma 3's and gpt-oss's last layers are full)
    mirrored = FAMILY_WINDOWS.get(family)
    release_cfg = json.loads((tmp_path / "release" / "config.json").read_text())
    assert release_cfg["layer_windows"] == (None if mirrored is None else [mirrored])
    layer = exported_cfg["transformer_layer_config"]
    assert layer["sliding_window"] == mirrored
    assert layer["layer_types"] == ["full_attention" if mirrored is None else "sliding_attention"]
