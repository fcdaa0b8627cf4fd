"""What a rank runs for ``gpufleet run`` and workload files: a script or a module as
``__main__`` (as ``python script.py`` would), or a command. They travel as the rank's
function, so logs, errors, retries and records are those of any run."""

from __future__ import annotations

import os
import runpy
import shlex
import subprocess
import sys


class ScriptExitError(Exception):
    """The script or command ended with a non-zero exit status."""


class ScriptEnded(SystemExit):
    """The script or module ended with status 0 (its end, or ``sys.exit(0)``): the rank
    leaves as its process would (``rank/worker.py`` keeps when, for the caller's diagnosis)."""

    def __init__(self, summary: str):
        super().__init__(0)
        self.summary = summary


def run_script(path: str, args: list[str]) -> None:
    """``python path args...`` in this rank: ``sys.argv`` and ``sys.path[0]`` as Python sets
    them; its end or ``sys.exit(0)`` is success (``ScriptEnded``), any other status a failure."""
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    _as_main(lambda: runpy.run_path(path, run_name="__main__"))


def run_module(name: str, args: list[str]) -> None:
    """``python -m name args...`` in this rank."""
    sys.argv = [name, *args]
    sys.path.insert(0, os.getcwd())
    _as_main(lambda: runpy.run_module(name, run_name="__main__", alter_sys=True))


def run_command(command: list[str] | str) -> None:
    """A command on this rank, with the rank's environment (RANK, WORLD_SIZE, ...) and its
    output in the rank's log; a non-zero exit fails the rank."""
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    code = subprocess.run(argv, stdin=subprocess.DEVNULL).returncode
    if code != 0:
        raise ScriptExitError(f"{shlex.join(argv)} exited with status {code}")


def _as_main(run) -> None:
    try:
        run()
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise ScriptExitError(f"{sys.argv[0]} exited with status {exc.code}") from None
    raise ScriptEnded(f"{sys.argv[0]} ended with exit status 0")
