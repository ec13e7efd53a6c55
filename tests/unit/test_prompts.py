"""Prompts stage: bad rows are reported by file, line and id and written out; good rows go on."""

import json

import pytest

from pipeline.prompts import load_prompts, read_prompt_file


def _write(path, lines):
    path.write_text("".join(l + "\n" for l in lines), encoding="utf-8")
    return str(path)


def test_bad_rows_are_reported_and_the_rest_kept(tmp_path):
    good = {"id": "a", "domain": "math", "messages": [{"role": "user", "content": "2+2?"}]}
    path = _write(tmp_path / "p.jsonl", [
        json.dumps(good),
        '{"id": "broken", "messages": [',                                    # malformed JSON
        json.dumps({"id": "nomsg"}),                                          # missing field
        json.dumps({"id": "empty", "messages": [{"role": "user", "content": "  "}]}),
        json.dumps({"id": "asst", "messages": [{"role": "assistant", "content": "hi"}]}),
        json.dumps({"messages": [{"role": "user", "content": "x"}]}),          # no id
        json.dumps({"id": "b", "messages": [{"role": "user", "content": "q"},
                                            {"role": "assistant", "content": "old answer"},
                                            {"role": "user", "content": "q2"}]}),
    ])
    rows, errors = read_prompt_file(path)
    assert [r["id"] for r in rows] == ["a", "b"]
    # the original assistant turn is discarded: the target regenerates it
    assert [m["role"] for m in rows[1]["messages"]] == ["user", "user"]
    by_line = {e["line"]: e for e in errors}
    assert set(by_line) == {2, 3, 4, 5, 6}
    assert "malformed JSON" in by_line[2]["error"] and by_line[2]["file"] == path
    assert by_line[3]["id"] == "nomsg" and "messages" in by_line[3]["error"]
    assert by_line[4]["id"] == "empty" and "empty" in by_line[4]["error"]
    assert "start with a user turn" in by_line[5]["error"]
    assert "'id'" in by_line[6]["error"]


def test_split_is_seeded_and_disjoint_and_duplicates_reported(tmp_path):
    rows = [json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"}]})
            for i in range(40)]
    a = _write(tmp_path / "a.jsonl", rows)
    b = _write(tmp_path / "b.jsonl", rows[:3])  # duplicate ids across files
    s1 = load_prompts([(a, None), (b, None)], 0.1, seed=3)
    s2 = load_prompts([(a, None), (b, None)], 0.1, seed=3)
    assert [r["id"] for r in s1.heldout] == [r["id"] for r in s2.heldout]
    assert len(s1.heldout) == 4 and len(s1.train) == 36
    assert not {r["id"] for r in s1.train} & {r["id"] for r in s1.heldout}
    assert sum("duplicate id" in e["error"] for e in s1.errors) == 3


def test_max_rows_and_directory_sources(tmp_path):
    d = tmp_path / "dir"
    d.mkdir()
    for name in ("x", "y"):
        _write(d / f"{name}.jsonl", [json.dumps({"id": f"{name}{i}", "messages": [
            {"role": "user", "content": "hello"}]}) for i in range(10)])
    split = load_prompts([(str(d), 4)], 0.0, seed=0)
    assert len(split.train) == 8 and not split.heldout


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompts([(str(tmp_path / "nope.jsonl"), None)], 0.0, 0)


def test_subsample_does_not_depend_on_where_the_file_lies(tmp_path):
    """The same config draws the same max_rows subsample in a checkout at any directory (a fresh
    clone in /tmp must resume the rows regenerated in another checkout)."""
    rows = [json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"}]})
            for i in range(50)]
    picked = []
    for where in ("one", "two/deeper"):
        (tmp_path / where).mkdir(parents=True)
        path = _write(tmp_path / where / "prompts.jsonl", rows)
        split = load_prompts([(path, 10)], 0.2, seed=7)
        picked.append(([r["id"] for r in split.train], [r["id"] for r in split.heldout]))
    assert picked[0] == picked[1]
    assert len(picked[0][0]) == 8 and len(picked[0][1]) == 2


def test_heldout_ids_keep_the_split_as_the_sources_grow(tmp_path):
    """prompts.heldout_ids_from: with the ids of a seeded split, the same sources give the same
    split, and a larger subsample keeps those held-out rows out of training, drawn or not."""
    from pipeline.prompts import PromptError, read_ids

    rows = [json.dumps({"id": f"r{i}", "domain": "chat",
                        "messages": [{"role": "user", "content": f"q{i}"}]}) for i in range(200)]
    path = _write(tmp_path / "p.jsonl", rows)
    small = load_prompts([(path, 40)], 0.1, seed=5)
    ids_file = _write(tmp_path / "heldout.jsonl", [json.dumps(r) for r in small.heldout])
    held = read_ids(ids_file)
    assert held == {r["id"] for r in small.heldout} and len(held) == 4

    again = load_prompts([(path, 40)], 0.3, seed=5, heldout_ids=held)  # the fraction is unused
    assert again.train == small.train and again.heldout == small.heldout

    grown = load_prompts([(path, 120)], 0.1, seed=5, heldout_ids=held)
    assert grown.heldout == small.heldout
    train_ids = {r["id"] for r in grown.train}
    assert not train_ids & held and len(train_ids) >= 116
    # held-out rows the subsample did not draw are held out all the same
    undrawn = {f"r{i}" for i in range(200)} - {r["id"] for r in small.train + small.heldout}
    picked = set(sorted(undrawn)[:3])
    other = load_prompts([(path, 40)], 0.1, seed=5, heldout_ids=picked)
    assert {r["id"] for r in other.heldout} == picked
    assert {r["id"] for r in other.train} == {r["id"] for r in small.train + small.heldout}

    with pytest.raises(ValueError, match=r"ids.jsonl: 1 held-out id\(s\) are in no prompt source"):
        load_prompts([(path, 40)], 0.1, seed=5, heldout_ids=held | {"gone"},
                     heldout_ids_file="ids.jsonl")
    bad = _write(tmp_path / "bad.jsonl", [json.dumps({"id": "a"}), json.dumps({"x": 1})])
    with pytest.raises(PromptError, match=r"bad.jsonl, line 2: a row without an 'id'"):
        read_ids(bad)
