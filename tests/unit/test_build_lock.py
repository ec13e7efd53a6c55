"""A torch extension build lock left by a killed process no longer hangs every later load
(serve/engine/build_lock.py): the decode attention kernel and DeepSpeed's CPU communication op."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from serve.engine.build_lock import BUILD_FLOCK, TORCH_LOCK_FILE, exclusive_build

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                          capture_output=True, text=True)


def test_a_lock_left_by_a_killed_loader_is_removed_and_the_next_build_goes_on(tmp_path):
    # a process dies the way a killed worker does: inside the build lock, holding torch's baton
    done = _python(f"""
        import os, signal
        from torch.utils.file_baton import FileBaton
        from serve.engine.build_lock import exclusive_build
        with exclusive_build({str(tmp_path)!r}):
            assert FileBaton(os.path.join({str(tmp_path)!r}, "lock")).try_acquire()
            os.kill(os.getpid(), signal.SIGKILL)
        """)
    assert done.returncode == -signal.SIGKILL
    assert (tmp_path / TORCH_LOCK_FILE).exists()  # what torch's next load would wait on forever

    start = time.monotonic()
    with exclusive_build(tmp_path, timeout_s=30, stale_after_s=1.0):
        assert not (tmp_path / TORCH_LOCK_FILE).exists()
        assert time.monotonic() - start < 25  # removed once 1 s old, not waited for forever
        from torch.utils.file_baton import FileBaton

        baton = FileBaton(str(tmp_path / TORCH_LOCK_FILE))
        assert baton.try_acquire()
        baton.release()


def test_a_live_builder_is_waited_for_and_a_long_one_named_in_the_error(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from serve.engine.build_lock import exclusive_build
            with exclusive_build({str(tmp_path)!r}):
                open({str(tmp_path / TORCH_LOCK_FILE)!r}, "w").close()  # torch's, live
                print("holding", flush=True)
                time.sleep(60)
            """)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(TimeoutError, match=str(tmp_path)):
            with exclusive_build(tmp_path, timeout_s=0.5, poll_s=0.05):
                pass
        assert (tmp_path / TORCH_LOCK_FILE).exists()  # a live builder's lock is left alone
    finally:
        holder.kill()
        holder.wait()
    # its holder gone, the lock is ours at once; torch's lock file, just written, might be a
    # loader's that does not take the build lock: waited for until it is stale_after_s old
    with pytest.raises(TimeoutError, match="does not take the build lock"):
        with exclusive_build(tmp_path, timeout_s=0.5, poll_s=0.05, stale_after_s=60):
            pass
    assert (tmp_path / TORCH_LOCK_FILE).exists()
    _age(tmp_path / TORCH_LOCK_FILE, 3600)
    with exclusive_build(tmp_path, timeout_s=5):
        assert not (tmp_path / TORCH_LOCK_FILE).exists()
    assert (tmp_path / BUILD_FLOCK).exists()


def _age(path: Path, seconds: float) -> None:
    """Date ``path`` back ``seconds`` (a lock a run killed that long ago left)."""
    then = time.time() - seconds
    os.utime(path, (then, then))


def _with_a_stale_lock(src: Path, dst: Path) -> None:
    """``dst``: a copy of build directory ``src`` (where one exists: its load is then quick) with
    the lock file a killed loader leaves."""
    if src.is_dir():
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns(TORCH_LOCK_FILE, BUILD_FLOCK))
    dst.mkdir(parents=True, exist_ok=True)
    (dst / TORCH_LOCK_FILE).touch()
    _age(dst / TORCH_LOCK_FILE, 3600)


def test_the_decode_kernel_loads_past_a_stale_lock(tmp_path):
    from serve.engine.decode_attention import build_directory

    built = build_directory()
    _with_a_stale_lock(built, tmp_path / built.name)
    # in a process of its own with a time limit: the old load waited for the lock forever
    done = _python("""
        from serve.engine.decode_attention import build_directory, decode_kernel
        print("built" if decode_kernel() else "not built", build_directory())
        """, env={"TORCH_EXTENSIONS_DIR": str(tmp_path)}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert str(tmp_path / built.name) in done.stdout
    assert not (tmp_path / built.name / TORCH_LOCK_FILE).exists()


def test_deepspeeds_cpu_comm_op_loads_past_a_stale_lock(tmp_path):
    name = "deepspeed_shm_comm"
    default_root = Path.home() / ".cache" / "dspark_ray" / "torch_extensions"
    _with_a_stale_lock(Path(os.environ.get("TORCH_EXTENSIONS_DIR", default_root)) / name,
                       tmp_path / name)
    done = _python(f"""
        import os
        from pipeline.train.worker import load_deepspeed_cpu_comm_op
        load_deepspeed_cpu_comm_op({str(tmp_path)!r})
        from deepspeed.ops.op_builder.builder import OpBuilder
        print("loaded" if {name!r} in OpBuilder._loaded_ops else "not loaded")
        """, env={"TORCH_EXTENSIONS_DIR": str(tmp_path)}, timeout=400)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "loaded"
    assert not (tmp_path / name / TORCH_LOCK_FILE).exists()
