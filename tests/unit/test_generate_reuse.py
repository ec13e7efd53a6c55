"""generate.reuse_from: answers an earlier run regenerated are taken instead of regenerated, only
for the same conversation, without duplicates, and a torn output line is cut first."""

import gzip
import json

import pytest

from pipeline.generate.hf import done_ids
from pipeline.generate.reuse import refile_answers, reuse_answers


def _prompt(rid, *turns):
    return {"id": rid, "domain": "chat", "messages": [{"role": "user", "content": t} for t in turns]}


def _answered(rid, *turns):
    messages = []
    for t in turns:
        messages += [{"role": "user", "content": t}, {"role": "assistant", "content": f"A:{t}"}]
    return {"id": rid, "domain": "chat", "messages": messages,
            "finish_reasons": ["stop"] * len(turns)}


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_reuse_takes_matching_conversations_and_regenerates_the_rest(tmp_path):
    earlier = tmp_path / "earlier.jsonl.gz"
    with gzip.open(earlier, "wt") as fh:
        for row in (_answered("a", "hi"), _answered("b", "other question"),  # b: another prompt
                    _answered("c", "one", "two"), {"id": "d", "messages": "broken"},
                    _answered("z", "not wanted")):
            fh.write(json.dumps(row) + "\n")
    partial = _answered("c", "one", "two")
    partial["finish_reasons"] = ["stop"]  # one reason for two answers: not a finished row
    second = tmp_path / "second.jsonl"
    second.write_text(json.dumps(partial) + "\n" + json.dumps(_answered("e", "five")) + "\n")
    out, errors = tmp_path / "gen" / "train.jsonl", tmp_path / "gen" / "errors.jsonl"
    out.parent.mkdir()
    out.write_text(json.dumps(_answered("e", "five")) + "\n" + '{"id": "x", "mess')  # torn tail
    rows = [_prompt("a", "hi"), _prompt("b", "b's question"), _prompt("c", "one", "two"),
            _prompt("d", "dee"), _prompt("e", "five")]

    counts = reuse_answers(rows, out, errors, [str(earlier), str(second)])

    assert counts == {"reused": 2, "reuse_mismatched": 2}  # b and d found but not reusable
    written = _rows(out)  # e was already there (not duplicated); the torn line is gone
    assert [r["id"] for r in written] == ["e", "a", "c"]
    assert written[1] == _answered("a", "hi")
    assert written[2]["messages"][3] == {"role": "assistant", "content": "A:two"}
    assert done_ids(out, errors) == {"a", "c", "e"}
    # a second call finds everything it can reuse done already (b and d still do not match)
    assert reuse_answers(rows, out, errors, [str(earlier)]) == {"reused": 0,
                                                                  "reuse_mismatched": 2}
    assert len(_rows(out)) == 3


def test_reuse_source_must_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match="reuse_from: file not found: .*nope.jsonl"):
        reuse_answers([_prompt("a", "hi")], tmp_path / "o.jsonl", tmp_path / "e.jsonl",
                      [str(tmp_path / "nope.jsonl")])


def test_the_first_source_wins_and_errored_ids_are_not_reused(tmp_path):
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    a1, a2 = _answered("a", "hi"), _answered("a", "hi")
    a2["messages"][1]["content"] = "another answer"
    b_bad, b_good = _answered("b", "other"), _answered("b", "bee")
    first.write_text(json.dumps(a1) + "\n" + json.dumps(b_bad) + "\n")
    second.write_text(json.dumps(a2) + "\n" + json.dumps(b_good) + "\n"
                      + json.dumps(_answered("c", "sea")) + "\n")
    out, errors = tmp_path / "train.jsonl", tmp_path / "errors.jsonl"
    errors.write_text(json.dumps({"id": "c", "stage": "generate", "error": "too long"}) + "\n")
    counts = reuse_answers([_prompt("a", "hi"), _prompt("b", "bee"), _prompt("c", "sea")], out,
                           errors, [str(first), str(second)])
    # b is mismatched in the first file but taken from the second: not counted as mismatched
    assert counts == {"reused": 2, "reuse_mismatched": 0}
    assert [r["messages"][1]["content"] for r in _rows(out)] == ["A:hi", "A:bee"]


def test_answers_are_refiled_under_the_current_split(tmp_path):
    """A split that changed under existing answers: a held-out prompt's answer leaves train.jsonl
    (the cache stage would train on it), one in no split is set aside, duplicates go."""
    out = tmp_path / "generate"
    out.mkdir()
    (out / "train.jsonl").write_text("".join(json.dumps(_answered(i, i)) + "\n"
                                             for i in ("a", "b", "gone")))
    (out / "heldout.jsonl").write_text(json.dumps(_answered("c", "c")) + "\n"
                                       + json.dumps(_answered("a", "a")) + "\n")
    counts = refile_answers(out, {"train": {"a", "c"}, "heldout": {"b"}})
    assert counts == {"moved": 2, "unused": 1}
    assert [r["id"] for r in _rows(out / "train.jsonl")] == ["a", "c"]
    assert [r["id"] for r in _rows(out / "heldout.jsonl")] == ["b"]
    assert [r["id"] for r in _rows(out / "unused.jsonl")] == ["gone"]
    before = {p.name: p.read_text() for p in out.iterdir()}
    assert refile_answers(out, {"train": {"a", "c"}, "heldout": {"b"}}) == {"moved": 0,
                                                                            "unused": 0}
    assert {p.name: p.read_text() for p in out.iterdir()} == before


def test_a_source_made_with_another_target_or_sampling_is_refused(tmp_path, caplog):
    from pipeline.config import load_config
    from pipeline.generate.reuse import (check_generation_record, generation_record,
                                         write_generation_record)

    cfg = load_config("infra/configs/smollm2_reference.yaml")
    mine = generation_record(cfg)
    source = tmp_path / "earlier" / "train.jsonl"
    source.parent.mkdir()
    source.write_text(json.dumps(_answered("a", "hi")) + "\n")
    with caplog.at_level("WARNING"):
        assert check_generation_record(str(source), mine) is False  # no record: assumed, said
    assert "no generation.json" in caplog.text
    write_generation_record(source.parent, mine)
    assert check_generation_record(str(source), mine) is True
    import os
    expanded = dict(mine, target=os.path.expanduser(mine["target"]))  # the same path
    assert check_generation_record(str(source), expanded) is True
    newer = dict(mine, sampling=dict(mine["sampling"], repetition_penalty=1.0))  # a later field
    assert check_generation_record(str(source), newer) is True
    hotter = generation_record(cfg.model_copy(update={"generate": cfg.generate.model_copy(
        update={"sampling": cfg.generate.sampling.model_copy(update={"temperature": 1.0})})}))
    other = dict(hotter, target="Qwen/Qwen3-4B")
    with pytest.raises(ValueError, match="temperature.*0.7.*1.0") as err:
        check_generation_record(str(source), other)
    assert "target '~/.cache/dspark_ray/models/SmolLM2-135M-Instruct' there, 'Qwen/Qwen3-4B'" \
        in str(err.value) and str(source) in str(err.value)
    (source.parent / "generation.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        check_generation_record(str(source), mine)


@pytest.mark.parametrize("config", ["infra/configs/smollm2_reference.yaml",
                                    "infra/configs/smollm2_reference_xl.yaml"])
def test_the_shipped_answers_record_matches_the_configs_that_reuse_them(config):
    from pipeline import storage
    from pipeline.config import load_config
    from pipeline.generate.reuse import check_generation_record, generation_record

    cfg = load_config(config)
    assert cfg.generate.reuse_from
    for path in cfg.generate.reuse_from:
        assert check_generation_record(storage.resolve(path), generation_record(cfg)) is True
