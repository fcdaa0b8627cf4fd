"""Ctrl-C during `.distributed()` stops every rank within seconds and re-raises
KeyboardInterrupt; nothing is left running."""

from __future__ import annotations

import os
import signal
import time

import pytest
from support import assert_all_gone, rank_lines, run_processes

pytestmark = pytest.mark.timeout(90)

# From SIGINT to the script's exit, and to every rank and helper process being gone.
INTERRUPT_BOUND_S = 10.0

SCRIPT = """
import signal
import sys
import time

from gpufleet import distributed, runtime

# Python's Ctrl-C handler, as a script started from a terminal has, even when the tests were
# started with SIGINT ignored (a background job of a shell without job control, nohup)
signal.signal(signal.SIGINT, signal.default_int_handler)


@distributed(gpus=2, runs_dir=sys.argv[1])
def sleeper():
    runtime.setup(timeout=30)
    print(f"rank {runtime.get_global_rank()} is sleeping", flush=True)
    time.sleep(300)
    return "woke up"


if __name__ == "__main__":
    try:
        sleeper.distributed()
    except KeyboardInterrupt:
        print("CAUGHT KeyboardInterrupt", flush=True)
        raise
    print("RETURNED NORMALLY", flush=True)
"""


@pytest.mark.parametrize("target", ["script", "process group"])
def test_ctrl_c_stops_every_rank_and_raises_keyboard_interrupt(target, tmp_path, start_script):
    script = start_script(SCRIPT, tmp_path / "runs", new_session=True)
    # The rank lines appear while the ranks are still running: the logs are live.
    script.wait_for_output(
        lambda out: all(f"rank {r} is sleeping" in rank_lines(out, r) for r in (0, 1)),
        timeout=60,
    )
    tree = script.sample_tree() + run_processes(tmp_path / "runs")
    assert len(tree) >= 2, f"expected the ranks among the run's processes: {tree}"

    interrupted = time.monotonic()
    if target == "script":
        os.kill(script.pid, signal.SIGINT)
    else:  # what a terminal's Ctrl-C does
        os.killpg(script.pid, signal.SIGINT)
    result = script.wait(timeout=INTERRUPT_BOUND_S + 20)
    took = time.monotonic() - interrupted

    assert took < INTERRUPT_BOUND_S, f"the script needed {took:.1f} s to stop"
    assert "CAUGHT KeyboardInterrupt" in result.stdout, result.explain()
    assert "RETURNED NORMALLY" not in result.stdout
    assert "KeyboardInterrupt" in result.stderr, result.explain()
    assert result.returncode in (-signal.SIGINT, 128 + signal.SIGINT, 1), result.explain()
    remaining = INTERRUPT_BOUND_S - (time.monotonic() - interrupted)
    assert_all_gone(tree + result.tree, grace=max(remaining, 0.5),
                    what="processes after Ctrl-C")
