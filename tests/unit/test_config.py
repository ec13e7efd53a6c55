"""Typed config: the shipped configs validate, overrides apply, bad input lists every problem."""

from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.overrides import parse_override

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["quickstart.yaml", "qwen3_4b.yaml"])
def test_shipped_configs_validate(name):
    cfg = load_config(ROOT / "infra" / "configs" / name)
    assert cfg.drafter.block_size == 7
    assert cfg.train.global_batch_size % (cfg.train.micro_batch_size * cfg.train.num_workers) == 0


def test_reference_settings_of_qwen3_4b():
    cfg = load_config(ROOT / "infra" / "configs" / "qwen3_4b.yaml")
    assert cfg.target.name_or_path == "Qwen/Qwen3-4B"
    assert cfg.target.layer_ids == [1, 9, 17, 25, 33]
    assert (cfg.drafter.num_hidden_layers, cfg.train.num_anchors, cfg.train.lr) == (5, 512, 6e-4)
    assert (cfg.train.global_batch_size, cfg.train.num_epochs, cfg.train.num_workers) == (512, 10, 8)


def test_overrides_are_parsed_as_yaml_and_revalidated():
    cfg = load_config(ROOT / "infra" / "configs" / "quickstart.yaml",
                      ["train.lr=3e-4", "eval.datasets={gsm8k: 3}", "drafter.head_type=rnn"])
    assert cfg.train.lr == 3e-4 and cfg.eval.datasets == {"gsm8k": 3}
    assert cfg.drafter.head_type == "rnn"
    assert parse_override("a.b=") == ("a.b", None)
    with pytest.raises(ConfigError, match="section.field=value"):
        parse_override("novalue")


def test_every_invalid_field_is_listed_and_unknown_keys_named():
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "infra" / "configs" / "quickstart.yaml",
                    ["train.lr=-1", "train.bogus=3", "drafter.head_type=x", "nosuch.key=1"])
    text = str(err.value)
    assert "4 problem(s)" in text
    for needle in ("train.lr", "train.bogus: unknown key", "drafter.head_type", "nosuch: unknown key"):
        assert needle in text


def test_cross_field_rules(tmp_path):
    with pytest.raises(ConfigError, match="multiple of"):
        load_config(ROOT / "infra" / "configs" / "quickstart.yaml", ["train.global_batch_size=9"])
    # quickstart's drafter asks for DSpark's heads: a DFlash drafter has none, each key named
    with pytest.raises(ConfigError, match=r"drafter.head_type: a DFlash drafter has no sequential"
                       r" head.*\n  drafter.confidence_head: a DFlash drafter has no confidence"):
        load_config(ROOT / "infra" / "configs" / "quickstart.yaml", ["drafter.drafter_type=dflash"])


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("run_dir: x\n")
    with pytest.raises(ConfigError, match="target: Field required"):
        load_config(empty)


def test_renamed_engine_field_keeps_run_fingerprints():
    """engine.num_draft_tokens became engine.num_speculative_tokens: an eval stage completed
    before the rename still counts as complete, and the old name still reads (deprecated)."""
    import hashlib
    import json

    from pipeline.stages import ADDED_LATER, NOT_FINGERPRINTED, stage_fingerprint

    quickstart = ROOT / "infra" / "configs" / "quickstart.yaml"
    cfg = load_config(quickstart)
    dumped = cfg.model_dump(mode="json")
    for section, key, default in ADDED_LATER:
        if dumped.get(section, {}).get(key, object()) == default:
            del dumped[section][key]
    for section, key in NOT_FINGERPRINTED:
        del dumped[section][key]
    dumped["engine"]["num_draft_tokens"] = dumped["engine"].pop("num_speculative_tokens")
    # the sections every stage up to eval read before stages were objects (written out: the
    # fingerprint of a run directory of that layout)
    sections = ["prompts", "storage_options", "target", "generate", "seed", "cache", "drafter",
                "train", "calibrate", "eval", "engine"]
    before = hashlib.sha256(json.dumps({s: dumped[s] for s in sections},
                                       sort_keys=True).encode()).hexdigest()
    assert stage_fingerprint(cfg, "eval") == before
    capped = load_config(quickstart, ["engine.num_speculative_tokens=3"])
    assert stage_fingerprint(capped, "eval") != before
    with pytest.warns(DeprecationWarning, match="engine.num_draft_tokens is deprecated"):
        old = load_config(quickstart, ["engine.num_draft_tokens=3"])
    assert stage_fingerprint(old, "eval") == stage_fingerprint(capped, "eval")


def test_a_speed_floor_needs_a_scheduler_with_an_sps_table():
    from serve.engine.config import EngineConfig

    assert EngineConfig(scheduler="dspark", min_tokens_per_s=10.0).min_tokens_per_s == 10.0
    with pytest.raises(ValueError, match="min_tokens_per_s needs scheduler dspark or async"):
        EngineConfig(scheduler="static_threshold", min_tokens_per_s=10.0)


def test_the_quickstart_fingerprints_stay_those_of_existing_run_directories():
    """Literal stage fingerprints of the shipped quickstart, as run directories made before this
    session's config fields (engine.seeded_sampling, engine.min_tokens_per_s, the renames) recorded
    them: a field added at its default must not make a finished stage look stale. (The values
    changed on purpose in session 27: the quickstart's dtypes went from bfloat16 to auto, which
    computes in fp32 on an AVX2-only CPU; and in session 28: its generate stage moved to the
    engine backend. drafter.sliding_window, added then at its default, changed nothing: before
    the backend change these still read 98e0ace975d5 / 92b38a928d4b / d678efdeeef9. In session
    30 the quickstart trains 170 instead of 280 steps, its eval decodes 32 instead of 40 new
    tokens and skips the fixed-gamma pass,
    for its 15-minute budget: train and eval were 642c1fd7b317 / 24c63ac665e5. In session 33 it
    evaluates held-out once at its last step, train.eval_every 170, for the eval report's train vs
    serve check: train and eval were 5fc1263ec1e3 / 3d656ac6e361. In session 42 it fine-tunes the
    shipped reference drafter on 100 prompts' 96-token answers for 16 steps and evaluates 14
    prompts at 40 tokens, for issue 41's 20 minutes on an AVX2-only CPU: generate, train and eval
    were 8150d903c77d / ee77161dea50 / 5aa1603b12cd.)"""
    from pipeline.stages import stage_fingerprint

    cfg = load_config("infra/configs/quickstart.yaml")
    assert {s: stage_fingerprint(cfg, s)[:12] for s in ("generate", "train", "eval")} == {
        "generate": "494b2de1e3b2", "train": "6af99934459c", "eval": "c07ec9bdad33"}
