"""Per-type drafter options (issue 44 item 3): each type's settings in an options model beside its
class, named by its spec; the shared config holds one type's options and is written flat, as
before."""

from __future__ import annotations

import pytest

from drafters import registry
from drafters.config import DrafterConfig
from drafters.options import FLAT_KEYS, DrafterOptions

# DrafterConfig().model_dump() and an Eagle3 contender's made from a 2-layer DSpark config, as
# the flat DrafterConfig of main before per-type options dumped them (stage fingerprints hash
# these dumps: a change here makes every earlier run look changed)
DSPARK_DUMP = {"drafter_type": "dspark", "num_layers": 5, "eagle3_num_layers": 1,
               "block_size": 7, "head_type": "markov", "markov_rank": 256, "qk_norm": None,
               "confidence_head": True, "loss_decay": None, "init": "random",
               "draft_vocab_size": 0, "sliding_window": "target", "anchor_features": False}
EAGLE3_FROM_DSPARK_DUMP = {**DSPARK_DUMP, "drafter_type": "eagle3", "num_layers": 2,
                           "head_type": "none", "markov_rank": 16, "confidence_head": False,
                           "draft_vocab_size": 8192}


@pytest.mark.parametrize("name, module, fields", [
    ("dspark", "drafters.dspark_options",
     {"num_layers", "init", "sliding_window", "anchor_features", "head_type", "markov_rank",
      "confidence_head"}),
    ("dflash", "drafters.dflash", {"num_layers", "init", "sliding_window", "anchor_features"}),
    ("eagle3", "drafters.eagle3", {"num_layers"})])
def test_each_type_declares_its_own_options_beside_it(name, module, fields):
    spec = registry.get_spec(name)
    assert issubclass(spec.options, DrafterOptions) and spec.options.__module__ == module
    assert set(spec.options.model_fields) == fields
    assert set(spec.options.flat_names().values()) <= set(FLAT_KEYS)
    shared = set(DrafterConfig.model_fields) - {"options"}
    assert shared == {"drafter_type", "block_size", "qk_norm", "loss_decay", "draft_vocab_size"}


def test_a_type_without_heads_is_configured_without_switching_dsparks_off():
    eagle = DrafterConfig(drafter_type="eagle3", eagle3_num_layers=2)
    assert (eagle.num_hidden_layers, eagle.head_type, eagle.confidence_head) == (2, "none", False)
    assert eagle.sliding_window is None and eagle.init == "random" and not eagle.anchor_features
    dflash = DrafterConfig(drafter_type="dflash", num_layers=3, sliding_window=64)
    assert (dflash.num_hidden_layers, dflash.sliding_window, dflash.head_type) == (3, 64, "none")


def test_flat_and_nested_forms_are_one_config():
    flat = DrafterConfig(num_layers=2, head_type="rnn", markov_rank=32, block_size=5)
    nested = DrafterConfig(block_size=5, options={"num_layers": 2, "head_type": "rnn",
                                                  "markov_rank": 32})
    assert flat == nested and flat.model_dump() == nested.model_dump()
    assert DrafterConfig.model_validate(flat.model_dump()) == flat  # a dump loads back
    eagle = DrafterConfig(drafter_type="eagle3", options={"num_layers": 3})
    assert eagle.model_dump()["eagle3_num_layers"] == 3


@pytest.mark.parametrize("kind, key, value, message", [
    ("eagle3", "head_type", "markov", "an Eagle3 drafter has no sequential head"),
    ("eagle3", "confidence_head", True, "an Eagle3 drafter has no confidence head"),
    ("eagle3", "sliding_window", 64, "an Eagle3 drafter attends its whole context"),
    ("eagle3", "init", "target_layers", "an Eagle3 drafter has no layers that could start"),
    ("eagle3", "anchor_features", True, "an Eagle3 drafter has no anchor slot"),
    ("dflash", "head_type", "rnn", "a DFlash drafter has no sequential head")])
def test_another_types_option_is_refused_by_name_where_it_would_need_a_part(kind, key, value,
                                                                             message):
    with pytest.raises(ValueError, match=message) as err:
        DrafterConfig(drafter_type=kind, **{key: value})
    assert err.value.errors()[0]["loc"] == (key,)


def test_invalid_options_are_named_by_their_flat_key():
    with pytest.raises(ValueError) as err:
        DrafterConfig(drafter_type="eagle3", options={"num_layers": 0})
    assert [e["loc"] for e in err.value.errors()] == [("eagle3_num_layers",)]
    with pytest.raises(ValueError) as err:
        DrafterConfig(head_type="lstm", markov_rank=0, block_size=0)
    assert {e["loc"] for e in err.value.errors()} == {("head_type",), ("markov_rank",),
                                                      ("block_size",)}  # every problem at once
    with pytest.raises(ValueError) as err:
        DrafterConfig(drafter_type="eagle3", options={"head_type": "none"})
    assert err.value.errors()[0]["type"] == "extra_forbidden"  # nested: only the type's own


def test_dumps_stay_as_the_flat_config_wrote_them():
    assert DrafterConfig().model_dump() == DSPARK_DUMP
    eagle = DrafterConfig(**{**DSPARK_DUMP, "drafter_type": "eagle3", "num_layers": 2,
                             "head_type": "none", "markov_rank": 16, "confidence_head": False,
                             "draft_vocab_size": 8192})
    assert eagle.model_dump() == EAGLE3_FROM_DSPARK_DUMP
    assert eagle == DrafterConfig(drafter_type="eagle3", draft_vocab_size=8192)  # same drafter
    assert list(eagle.model_dump()) == list(DSPARK_DUMP)  # the flat layout's key order


def test_binding_to_a_target_keeps_the_options_and_the_dump():
    from tests.tiny import tiny_target

    target = tiny_target()
    eagle = DrafterConfig(drafter_type="eagle3", num_layers=2, markov_rank=16, block_size=4)
    bound = eagle.for_target(target.config, "t", [1, 3])
    assert bound.options == eagle.options and bound.num_hidden_layers == 1
    assert {k: bound.model_dump()[k] for k in eagle.model_dump()} == {
        **eagle.model_dump(), "qk_norm": True, "loss_decay": 4.0}
    dspark = DrafterConfig(num_layers=2, head_type="rnn", block_size=4).for_target(
        target.config, "t", [1, 3])
    assert (dspark.options.num_layers, dspark.options.head_type) == (2, "rnn")


def test_assignment_and_copies_keep_the_options_the_types():
    cfg = DrafterConfig(num_layers=2)
    with pytest.raises(ValueError, match="an Eagle3 drafter.s options are Eagle3Options"):
        cfg.drafter_type = "eagle3"  # DSpark's options under another type
    with pytest.raises(ValueError, match="drafter_type must be one of"):
        cfg.drafter_type = "bogus"
    assert cfg.drafter_type == "dspark"  # a refused assignment leaves the config as it was
    cfg.options = {"num_layers": 3, "head_type": "rnn"}  # validated as the type's options
    assert type(cfg.options).__name__ == "DSparkOptions" and cfg.head_type == "rnn"
    with pytest.raises(ValueError, match="options.num_layers"):
        cfg.options = {"num_layers": 0}
    # a copy that touches the options is a new config: validated, the dump following it
    assert cfg.model_copy(update={"init": "target_layers"}).init == "target_layers"
    assert cfg.model_copy(update={"num_layers": 4}).model_dump()["num_layers"] == 4
    with pytest.raises(ValueError, match="no sequential head"):
        cfg.model_copy(update={"drafter_type": "dflash"})  # its head_type rnn is refused there
    assert cfg.model_copy(update={"draft_vocab_size": 5}).options == cfg.options


@pytest.mark.parametrize("kw, loc", [
    (dict(drafter_type="eagle3", num_layers=0), "num_layers"),  # still a size
    (dict(drafter_type="dflash", markov_rank="x"), "markov_rank"),
    (dict(options={"num_layers": 2}, num_layers=3), "num_layers")])  # flat and nested differ
def test_sizes_of_parts_a_type_lacks_and_conflicting_forms_are_refused(kw, loc):
    with pytest.raises(ValueError) as err:
        DrafterConfig(**kw)
    assert err.value.errors()[0]["loc"] == (loc,)


def test_init_from_compares_the_heads_rank_through_the_options(tmp_path):
    from drafters.loading import build_drafter
    from pipeline.train.worker import init_weights
    from tests.tiny import tiny_target

    target = tiny_target()
    emb, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight

    def drafter(**kw):
        cfg = DrafterConfig(num_layers=1, block_size=4, **kw).for_target(target.config, "t",
                                                                          [1, 3])
        return build_drafter(cfg, emb, head)

    drafter(markov_rank=16).save_pretrained(tmp_path / "d")
    init_weights(drafter(markov_rank=16), str(tmp_path / "d"))  # same architecture: loads
    with pytest.raises(ValueError, match="markov_rank: 16 != 8"):
        init_weights(drafter(markov_rank=8), str(tmp_path / "d"))
