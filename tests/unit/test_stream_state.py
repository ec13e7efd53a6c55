"""The consumed-sample record of streamed training (pipeline/stream_state.py): what a restart
leaves out, when an epoch counts as complete, and the counts the fault matrix reads."""

from __future__ import annotations

from pipeline.stream_state import (STATE_FILE, StreamState, merged_state, read_state,
                                   worker_records)


def test_records_merge_into_per_epoch_sets_and_complete_epochs_drop_their_ids():
    state = StreamState(rows_per_epoch=4)
    assert state.first_open_epoch() == 0
    workers = [worker_records([[(0, "a"), (0, "b")], [(0, "c"), (1, "x")]]),
               worker_records([[(0, "b")]])]  # "b" twice: a repeat is counted, not stored twice
    merged_state(state, workers)
    assert state.consumed == {0: {"a", "b", "c"}, 1: {"x"}}
    assert state.seen == {0: 4, 1: 1} and state.distinct == {0: 3, 1: 1}
    assert state.first_open_epoch() == 0
    state.add(0, ["d"])
    assert 0 not in state.consumed and state.complete(0)  # its ids are no longer kept
    assert state.distinct[0] == 4 and state.seen[0] == 5
    assert state.first_open_epoch() == 1
    state.add(1, ["w", "y", "z"])
    assert state.first_open_epoch() == 2 and not state.consumed


def test_the_record_round_trips_through_a_checkpoint_file(tmp_path):
    state = StreamState(3)
    state.add(0, ["a", "b", "c"])
    state.add(1, ["q"])
    (tmp_path / STATE_FILE).write_text(state.to_json())
    back = read_state(str(tmp_path), 3)
    assert back.consumed == {1: {"q"}} and back.seen == state.seen
    assert back.distinct == state.distinct and back.first_open_epoch() == 1
    # no record (a checkpoint of the cache path, or none): start from nothing
    assert read_state(None, 3).first_open_epoch() == 0
    assert read_state(str(tmp_path / "nowhere"), 3).consumed == {}


def test_a_record_that_cannot_continue_a_stream_is_refused_naming_it(tmp_path):
    import pytest

    from pipeline.stream_state import StreamRecordError

    ckpt = tmp_path / "checkpoint_1"
    ckpt.mkdir()
    with pytest.raises(StreamRecordError, match="has no stream_state.json"):
        read_state(str(ckpt), 3, require=True)
    state = StreamState(3)
    state.add(0, ["a"])
    (ckpt / STATE_FILE).write_text(state.to_json())
    with pytest.raises(StreamRecordError, match="counts 3 samples an epoch, the generate "
                                                "output now makes 5"):
        read_state(str(ckpt), 5)
    assert read_state(str(ckpt), 3, require=True).consumed == {0: {"a"}}


def test_epochs_complete_after_an_open_one_are_left_out_of_a_rebuilt_stream():
    """Epoch 1 complete while epoch 0 is still open: the stream restarts at epoch 0 and none of
    epoch 1 comes again (pipeline.feature_stream._positions with the stream's skip sets)."""
    import numpy as np

    from pipeline.feature_stream import _positions

    state = StreamState(3)
    state.add(0, ["a"])
    state.add(1, ["a", "b", "c"])
    assert state.first_open_epoch() == 0 and state.complete(1)
    skip = {0: np.array([0]), 1: np.arange(3)}  # as TrainStream.dataset builds them
    got = _positions({"id": np.arange(9)}, first_epoch=0, num_conversations=3, seed=0, skip=skip)
    assert list(got["epoch"]) == [0, 0, 2, 2, 2]
    assert 0 not in set(got["conversation"][:2])
