"""Two runs at once on one machine: no port collision, both succeed."""

from __future__ import annotations

import ast
import inspect
import threading

import pytest

from gpufleet import distributed, runtime
from support import assert_all_gone

pytestmark = pytest.mark.timeout(120)


def make_overlapping_job():
    """A job (defined in a function, so it travels by value) whose ranks wait until both runs
    are inside their functions, so the runs surely overlap, then do collectives in their run."""

    def overlapping_job(meeting_dir: str, name: str):
        import os
        import time
        from pathlib import Path

        import torch
        import torch.distributed as dist

        runtime.setup(timeout=30)
        rank = runtime.get_global_rank()
        meeting = Path(meeting_dir)
        (meeting / f"{name}-{rank}").touch()
        deadline = time.monotonic() + 60
        while len(list(meeting.iterdir())) < 4:
            if time.monotonic() > deadline:
                raise TimeoutError("the other run never started")
            time.sleep(0.05)
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        dist.barrier()
        return (name, rank, total.item(), os.environ["MASTER_PORT"])

    return overlapping_job


SCRIPT = """
import sys
from gpufleet import distributed, runtime

{source}

if __name__ == "__main__":
    meeting, name, runs = sys.argv[1:]
    fn = distributed(gpus=2, runs_dir=runs, logs="none")(make_overlapping_job())
    print("RESULTS", fn.distributed(meeting, name), flush=True)
"""


def check(results, name):
    assert [r[:3] for r in results] == [(name, 0, 3.0), (name, 1, 3.0)]
    return results[0][3]


def test_two_scripts_at_once(tmp_path, start_script):
    meeting = tmp_path / "meeting"
    meeting.mkdir()
    code = SCRIPT.format(source=inspect.getsource(make_overlapping_job))
    scripts = [start_script(code, meeting, name, tmp_path / f"runs-{name}") for name in "ab"]
    done = [s.wait(100) for s in scripts]

    ports = []
    for name, result in zip("ab", done):
        assert result.returncode == 0, result.explain()
        (line,) = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULTS ")]
        ports.append(check(ast.literal_eval(line.removeprefix("RESULTS ")), name))
        assert_all_gone(result.tree, what=f"processes of script {name}")
    assert ports[0] != ports[1]


def test_two_threads_at_once(tmp_path, runs_dir):
    meeting = tmp_path / "meeting"
    meeting.mkdir()
    job = distributed(gpus=2, runs_dir=runs_dir, logs="none")(make_overlapping_job())
    outcomes = {}

    def run(name):
        try:
            outcomes[name] = job.distributed(str(meeting), name)
        except BaseException as exc:  # reported below
            outcomes[name] = exc

    threads = [threading.Thread(target=run, args=(name,)) for name in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)

    assert all(not t.is_alive() for t in threads)
    for name in "ab":
        assert not isinstance(outcomes[name], BaseException), outcomes[name]
    assert check(outcomes["a"], "a") != check(outcomes["b"], "b")
