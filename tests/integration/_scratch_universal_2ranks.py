import json, shutil
import pytest
from .test_train_ray import _train, tiny_cache  # noqa: F401


def test_forced_universal_two_ranks(tmp_path, tiny_cache, tiny_target_dir):
    _, log_a = _train(tiny_cache, tiny_target_dir, tmp_path / "a", num_epochs=3, checkpoint_every=3)
    ckpts = {json.loads(p.read_text())["step"]: p.parent
             for p in (tmp_path / "a" / "ray_train").rglob("train_state.json")}
    src = tmp_path / "copy"
    shutil.copytree(ckpts[3], src)
    st = json.loads((src / "train_state.json").read_text()); st["world_size"] = 1
    (src / "train_state.json").write_text(json.dumps(st))
    _, log_b = _train(tiny_cache, tiny_target_dir, tmp_path / "b", num_epochs=3, num_workers=2,
                      resume_from=str(src))
    assert [h["step"] for h in log_b] == [4, 5, 6]
    for a, b in zip(log_a[3:], log_b):
        print("LOSS", a["loss"], b["loss"], a["lr"], b["lr"])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-6)
