"""A run's own files cannot be kept (a full disk, its folder deleted): the run still ends with
its own error, says which file system or folder, leaves its record right and nothing running."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from gpufleet import RunFailedError, attach, distributed, runtime
from support import assert_all_gone, rank_processes

pytestmark = pytest.mark.timeout(90)

DELETE_DETECTION_BOUND_S = 10.0


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB file system of its own (tmpfs: root only), unmounted afterwards."""
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small file system here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _only_run(runs: Path):
    (folder,) = [p for p in runs.iterdir() if p.is_dir()]
    return attach(folder.name, runs)


def test_a_result_too_big_for_the_disk_is_named_and_the_record_says_failed(small_disk):
    runs = small_disk / "runs"

    @distributed(gpus=2, runs_dir=runs, logs="none")
    def big_result():
        return b"x" * (24 * 2**20) if runtime.get_global_rank() == 1 else "small"

    with pytest.raises(RunFailedError) as info:
        big_result.distributed()
    text = str(info.value)
    assert info.value.failures[0].rank == 1, text
    assert "No space left on device" in text and str(runs) in text, text
    assert "full" in text, text
    assert _only_run(runs).status() == "failed"


def test_logs_that_fill_the_disk_end_the_run_with_its_own_error_and_status(small_disk):
    runs = small_disk / "runs"

    @distributed(gpus=2, runs_dir=runs, logs="none")
    def floods_its_log():
        line = "y" * 1023
        while True:
            print(line)

    with pytest.raises(RunFailedError) as info:
        floods_its_log.distributed()
    text = str(info.value)
    assert "full" in text and str(small_disk) in text, text
    run = _only_run(runs)
    assert run.status() == "failed", run.record()
    with pytest.raises(RunFailedError):
        run.result()


def test_a_run_whose_folder_is_deleted_is_stopped_at_once(runs_dir, tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()

    @distributed(gpus=2, runs_dir=runs_dir, logs="none", max_retries=1)
    def sleeps(pid_path):
        import os
        import time

        with open(f"{pid_path}/rank-{runtime.get_global_rank()}", "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)

    deleted_at = []

    def delete_when_running():
        while len(list(pid_dir.iterdir())) < 2:
            time.sleep(0.05)
        (folder,) = runs_dir.iterdir()
        shutil.rmtree(folder)
        deleted_at.append((time.monotonic(), folder))

    deleter = threading.Thread(target=delete_when_running)
    deleter.start()
    with pytest.raises(RunFailedError) as info:
        sleeps.distributed(str(pid_dir))
    deleter.join()
    when, folder = deleted_at[0]
    text = str(info.value)
    assert time.monotonic() - when < DELETE_DETECTION_BOUND_S
    assert "deleted" in text and str(folder) in text, text
    assert "attempt 2" not in text, "a run whose folder is gone is not retried"
    assert not runs_dir.joinpath(folder.name).exists()
    assert_all_gone(rank_processes(pid_dir), what="ranks of the deleted run")


def test_a_queued_run_whose_folder_is_deleted_ends_without_starting(runs_dir, monkeypatch):
    import psutil

    monkeypatch.setenv("GPUFLEET_VIRTUAL_GPUS", "1")

    @distributed(gpus=1, runs_dir=runs_dir, timeout=60, logs="none")
    def hold(seconds):
        import time

        time.sleep(seconds)
        return seconds

    first = hold.submit(20)
    queued = hold.submit(1)
    deadline = time.monotonic() + 30
    # queued, and its supervisor's pid recorded (a record is written a field at a time)
    while not (first.status() == "running" and queued.status() == "queued"
               and "supervisor" in queued.record()):
        assert time.monotonic() < deadline, (first.status(), queued.status())
        time.sleep(0.1)
    supervisor = psutil.Process(queued.record()["supervisor"]["pid"])
    shutil.rmtree(queued.path)
    supervisor.wait(DELETE_DETECTION_BOUND_S)  # psutil.TimeoutExpired if it waits on
    assert first.status() == "running", "the run holding the GPU goes on"
    assert first.cancel() == "cancelled"
