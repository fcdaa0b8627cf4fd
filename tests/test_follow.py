"""Following a run shows what its `logs` option says: the ranks a workload file's `logs:` or a
`--logs` flag chose, live with `gpufleet submit --follow`, later with `gpufleet logs --follow`,
and from Python with `Run.logs(follow=True)`; every rank's log stays on disk all the same.

What a user relies on:

- `logs: rank0` in a workload file: `gpufleet submit w.yaml --follow` prints rank 0's lines
  only, as `gpufleet run --logs rank0` would.
- `gpufleet submit w.yaml --logs 1`, then `gpufleet logs RUN --follow`: rank 1's lines only;
  `gpufleet logs RUN` (not following) prints every rank's log, and `--rank N` picks one,
  following or not.
- `@distributed(logs="rank0")` and `fn.submit()`: `run.logs(follow=True)` prints rank 0's
  lines; `run.logs(rank=1, follow=True)` prints rank 1's.
- Asked for when following (`gpufleet logs RUN --follow --logs all`, `run.logs(follow=True,
  logs=[1])`), other ranks are shown than the run's option chose.
"""

from __future__ import annotations

import io
import json

import pytest
from support import prefixed_ranks, rank_lines
from test_cli_input import cli_env, explain, gpufleet, write

from gpufleet import distributed

pytestmark = pytest.mark.timeout(120)

TALKER = "import os\nfor i in range(3):\n    print('line', i, 'of', os.environ['RANK'], flush=True)\n"


def cli(tmp_path, *args):
    return gpufleet(*args, cwd=tmp_path, env=cli_env(tmp_path), timeout=100)


def test_submit_follow_shows_the_ranks_of_the_workload_files_logs(tmp_path):
    write(tmp_path / "talker.py", TALKER)
    write(tmp_path / "w.yaml", "script: talker.py\ngpus: 2\ntracking: false\nlogs: rank0\n")
    proc = cli(tmp_path, "submit", "w.yaml", "--follow")
    assert proc.returncode == 0, explain(proc)
    assert rank_lines(proc.stdout, 0) == [f"line {i} of 0" for i in range(3)], explain(proc)
    assert prefixed_ranks(proc.stdout) == {0}, "logs: rank0, yet other ranks were shown\n" + explain(proc)


def test_logs_follow_later_shows_the_ranks_of_the_submit_flag_and_the_files_keep_all(tmp_path):
    write(tmp_path / "talker.py", TALKER)
    write(tmp_path / "w.yaml", "script: talker.py\ngpus: 2\ntracking: false\n")
    started = cli(tmp_path, "submit", "w.yaml", "--logs", "1", "--json")
    assert started.returncode == 0, explain(started)
    run = json.loads(started.stdout)["id"]

    followed = cli(tmp_path, "logs", run, "--follow")  # to the run's end
    assert followed.returncode == 0, explain(followed)
    assert rank_lines(followed.stdout, 1) == [f"line {i} of 1" for i in range(3)], explain(followed)
    assert prefixed_ranks(followed.stdout) == {1}, "--logs 1, yet other ranks were followed\n" + explain(followed)

    kept = cli(tmp_path, "logs", run)
    assert prefixed_ranks(kept.stdout) == {0, 1}, "every rank's log is kept\n" + explain(kept)
    one = cli(tmp_path, "logs", run, "--rank", "0", "--follow")  # the rank asked for wins
    assert rank_lines(one.stdout, 0) == [f"line {i} of 0" for i in range(3)], explain(one)
    every = cli(tmp_path, "logs", run, "--follow", "--logs", "all")  # and so do the ranks asked for
    assert prefixed_ranks(every.stdout) == {0, 1}, "--logs all when following\n" + explain(every)


def test_run_logs_follow_shows_the_ranks_of_the_functions_logs(runs_dir):
    @distributed(gpus=2, logs="rank0", runs_dir=runs_dir, tracking=False)
    def talks():
        from gpufleet import runtime

        for i in range(3):
            print("line", i, "of", runtime.get_global_rank(), flush=True)

    run = talks.submit()
    followed = io.StringIO()
    run.logs(follow=True, out=followed)
    assert run.status() == "succeeded"
    assert rank_lines(followed.getvalue(), 0) == [f"line {i} of 0" for i in range(3)], followed.getvalue()
    assert prefixed_ranks(followed.getvalue()) == {0}, followed.getvalue()

    chosen = io.StringIO()
    run.logs(rank=1, follow=True, out=chosen)
    assert rank_lines(chosen.getvalue(), 1) == [f"line {i} of 1" for i in range(3)], chosen.getvalue()

    asked = io.StringIO()
    run.logs(follow=True, out=asked, logs=[1])
    assert prefixed_ranks(asked.getvalue()) == {1}, asked.getvalue()
