"""backend: vllm (serve/vllm_app.py): the serve config maps onto vLLM's speculative_config from the
exported drafter; without vLLM installed the app refuses with a clear message. The application
graph itself is built in tests/interop (vLLM installed)."""

from __future__ import annotations

import pytest

from drafters.export import export
from serve.config import ServeConfig
from serve.engine.target_loading import load_target
from serve.vllm_app import speculative_config
from tests.tiny import tiny_drafter


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_target_dir):
    root = tmp_path_factory.mktemp("vllm_app")
    drafter = tiny_drafter(load_target(str(tiny_target_dir)), layer_ids=(1, 3))
    drafter.config.target_name_or_path = str(tiny_target_dir)
    drafter.save_pretrained(root / "drafter")
    export(root / "drafter", root / "vllm", "vllm")
    return root / "vllm"


def _cfg(engine: dict | None = None, **vllm):
    return ServeConfig.model_validate({"target": "Qwen/Qwen3-4B", "backend": "vllm",
                                       "vllm": vllm, "engine": engine or {}})


def test_the_export_becomes_vllms_speculative_config(exported):
    spec = speculative_config(_cfg(drafter_export=str(exported)))
    assert spec == {"model": str(exported), "method": "dspark", "num_speculative_tokens": 4,
                    "enable_adaptive_verification": True}
    capped = _cfg({"num_speculative_tokens": 2}, drafter_export=str(exported),
                  adaptive_verification=False)
    assert speculative_config(capped)["num_speculative_tokens"] == 2
    assert speculative_config(_cfg()) is None  # the target alone


def test_bad_exports_and_settings_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="drafters.export"):
        speculative_config(_cfg(drafter_export=str(tmp_path)))
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ValueError, match="not a drafter vLLM serves"):
        speculative_config(_cfg(drafter_export=str(tmp_path)))
    with pytest.raises(ValueError, match="min_replicas"):
        _cfg(min_replicas=3, max_replicas=2)


def test_without_vllm_the_backend_says_what_to_install():
    pytest.importorskip("ray.serve")
    try:
        import vllm  # noqa: F401
        pytest.skip("vLLM is installed here: tests/interop builds the app")
    except ImportError:
        pass
    from serve.app import build_app

    with pytest.raises(ImportError, match="backend 'vllm' needs vLLM"):
        build_app({"target": "Qwen/Qwen3-4B", "backend": "vllm"})


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_a_dflash_export_is_served_as_vllms_dflash(tmp_path, tiny_target_dir, fmt):
    """DFlash exports (either format) map to method "dflash"; their block_size counts the anchor
    slot, so vLLM drafts block_size - 1 tokens and no more."""
    drafter = tiny_drafter(load_target(str(tiny_target_dir)), layer_ids=(1, 3),
                           drafter_type="dflash")
    drafter.config.target_name_or_path = str(tiny_target_dir)
    drafter.save_pretrained(tmp_path / "drafter")
    export(tmp_path / "drafter", tmp_path / fmt, fmt)
    spec = speculative_config(_cfg(drafter_export=str(tmp_path / fmt)))
    assert spec == {"model": str(tmp_path / fmt), "method": "dflash", "num_speculative_tokens": 4}
    with pytest.raises(ValueError, match="exceeds the 4 tokens"):
        speculative_config(_cfg({"num_speculative_tokens": 5}, drafter_export=str(tmp_path / fmt)))


def test_the_old_names_of_the_serving_cap_are_read_with_a_deprecation_message(exported):
    """engine.num_draft_tokens and vllm.num_speculative_tokens are engine.num_speculative_tokens
    now (one cap for both backends); both old and new set is refused."""
    from serve.engine.config import EngineConfig

    with pytest.warns(DeprecationWarning, match="engine.num_speculative_tokens"):
        assert EngineConfig(num_draft_tokens=3).num_speculative_tokens == 3
    with pytest.raises(ValueError, match="old name"):
        EngineConfig(num_draft_tokens=3, num_speculative_tokens=2)
    with pytest.warns(DeprecationWarning, match="vllm.num_speculative_tokens is deprecated"):
        old = _cfg(drafter_export=str(exported), num_speculative_tokens=2)
    assert old.engine.num_speculative_tokens == 2
    assert speculative_config(old)["num_speculative_tokens"] == 2
    with pytest.raises(ValueError, match="set only the engine's"):
        _cfg({"num_speculative_tokens": 3}, drafter_export=str(exported), num_speculative_tokens=2)
