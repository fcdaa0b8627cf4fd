"""Notebooks: the quick-start notebook runs in a real Jupyter kernel, and interrupting a running
`.distributed()` cell stops every rank and leaves the kernel usable with no process behind.

The kernel runs this interpreter (the venv) through a kernelspec written into a temp folder;
HOME and the Jupyter/IPython folders point at temp folders too, so nothing touches the real home
folder (run folders of the notebook included).
"""

from __future__ import annotations

import json
import queue
import re
import sys
import time

import nbformat
import psutil
import pytest
from jupyter_client import KernelManager
from nbclient import NotebookClient
from support import EXAMPLES, assert_all_gone, descendants, is_template, rank_lines, run_processes

QUICKSTART = EXAMPLES / "quickstart.ipynb"
KERNEL = "gpufleet-test"
GPUFLEET_ERRORS = {"GpufleetError", "RunFailedError", "RunTimeoutError", "ConfigError",
                   "PayloadError"}
# From the kernel interrupt to the cell's KeyboardInterrupt, and to every rank being gone.
INTERRUPT_BOUND_S = 10.0


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    """A kernelspec for this interpreter, and private HOME / Jupyter / IPython folders."""
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "gpufleet test (venv)",
        "language": "python",
    }))
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "jupyter-data"))
    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(tmp_path / "jupyter-config"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "jupyter-runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "mpl"))
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    return tmp_path


def stream_text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream")


def result_text(cell) -> str:
    return "".join(o.get("data", {}).get("text/plain", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "execute_result")


@pytest.mark.timeout(180)
def test_quickstart_notebook_shows_rank_lines_and_results(kernel_env):
    assert QUICKSTART.is_file(), "examples/quickstart.ipynb is missing"
    nb = nbformat.read(QUICKSTART, as_version=4)
    # Cells tagged raises-exception may raise (a failure demo); any other error fails here.
    NotebookClient(nb, kernel_name=KERNEL, timeout=120, startup_timeout=60,
                   resources={"metadata": {"path": str(kernel_env)}}).execute()

    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    runs = [c for c in code_cells if ".distributed(" in c.source
            and not any(o.get("output_type") == "error" for o in c.outputs)]
    assert runs, "the notebook must call .distributed() successfully in some cell"
    cell = runs[0]
    assert rank_lines(stream_text(cell), 0), stream_text(cell)
    assert rank_lines(stream_text(cell), 1), stream_text(cell)
    shown = result_text(cell)
    assert shown, "the cell should display the results"
    assert shown.lstrip().startswith("["), f"results are a list, one entry per rank: {shown}"
    # The results of both ranks: quickstart returns {"rank": r, ...} from each.
    assert re.search(r"'rank': 0\b", shown) and re.search(r"'rank': 1\b", shown), shown
    for c in code_cells:
        for o in c.outputs:
            if o.get("output_type") == "error":  # only in raises-exception cells
                assert o["ename"] in GPUFLEET_ERRORS, f"unexpected {o['ename']} in {c.source}"
                assert "rank" in o["evalue"]


INTERRUPTED_CELL = """
import time
from gpufleet import distributed, runtime


@distributed(gpus=2, runs_dir={runs!r})
def nap():
    runtime.setup(timeout=30)
    print(f"rank {{runtime.get_global_rank()}} is napping", flush=True)
    time.sleep(300)


nap.distributed()
"""

AFTER_CELL = """
@distributed(gpus=2, runs_dir={runs!r}, logs="none")
def again():
    runtime.setup(timeout=30)
    return runtime.get_global_rank()


print("AGAIN", again.distributed())
"""


class Kernel:
    """A started kernel with a client; collects the output of one execution."""

    def __init__(self, cwd):
        self.km = KernelManager(kernel_name=KERNEL)
        self.km.start_kernel(cwd=str(cwd))
        self.client = self.km.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)
        self.pid = self.km.provisioner.process.pid

    def execute(self, code):
        return self.client.execute(code)

    def read_until(self, msg_id, predicate, timeout):
        """Read iopub messages of msg_id until predicate(stream_text, msgs) holds."""
        text, msgs = "", []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.client.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            msgs.append(msg)
            if msg["msg_type"] == "stream":
                text += msg["content"]["text"]
            if predicate(text, msgs):
                return text, msgs
        pytest.fail(f"kernel output not as expected within {timeout} s:\n{text}\n"
                    f"{[m['msg_type'] for m in msgs]}")

    def shutdown(self):
        self.client.stop_channels()
        self.km.shutdown_kernel(now=True)


def idle(text, msgs):
    return any(m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
               for m in msgs)


@pytest.mark.timeout(150)
def test_interrupting_a_running_cell_stops_every_rank(kernel_env):
    runs = str(kernel_env / "runs")
    kernel = Kernel(kernel_env)
    try:
        msg_id = kernel.execute(INTERRUPTED_CELL.format(runs=runs))
        # Rank lines reach the cell while it is still running.
        kernel.read_until(msg_id, lambda text, _: all(
            f"[rank {r}] rank {r} is napping" in text for r in (0, 1)), timeout=60)
        tree = descendants(kernel.pid) + run_processes(kernel_env / "runs")
        assert len(tree) >= 2, f"the ranks should be running for the kernel: {tree}"

        interrupted = time.monotonic()
        kernel.km.interrupt_kernel()
        _, msgs = kernel.read_until(msg_id, idle, timeout=INTERRUPT_BOUND_S + 20)
        took = time.monotonic() - interrupted
        errors = [m["content"] for m in msgs if m["msg_type"] == "error"]

        assert took < INTERRUPT_BOUND_S, f"the cell needed {took:.1f} s to stop"
        assert [e["ename"] for e in errors] == ["KeyboardInterrupt"], errors
        remaining = INTERRUPT_BOUND_S - (time.monotonic() - interrupted)
        assert_all_gone(tree, grace=max(remaining, 0.5), what="ranks after the interrupt")
        assert [p for p in psutil.Process(kernel.pid).children(recursive=True) if not is_template(p)] == []

        # The kernel is still usable: the next call runs normally.
        msg_id = kernel.execute(AFTER_CELL.format(runs=runs))
        text, msgs = kernel.read_until(msg_id, idle, timeout=60)
        assert "AGAIN [0, 1]" in text, (text, [m["content"] for m in msgs
                                               if m["msg_type"] == "error"])
    finally:
        kernel.shutdown()


SUBMIT_CELL = """
import os, time
from gpufleet import distributed, runtime


@distributed(gpus=2, runs_dir={runs!r}, timeout=120)
def slow_sum(go):
    runtime.setup(timeout=30)
    while not os.path.exists(go):  # the test says when to go on, after the kernel is gone
        time.sleep(0.1)
    print(f"rank {{runtime.get_global_rank()}} went on", flush=True)
    return runtime.get_global_rank() * 10


kept = slow_sum.options(detach=True).submit({go!r})
tied = slow_sum.submit({go!r})
while kept.status() != "running" or tied.status() != "running":
    time.sleep(0.1)
print("IDS", kept.id, tied.id)
"""


@pytest.mark.timeout(150)
def test_a_detached_run_survives_its_kernel_and_is_reattached(kernel_env):
    """A detached run goes on after its kernel is shut down; another process gets its logs
    and result by id. A run submitted without detach is cancelled with its kernel."""
    import gpufleet

    runs, go = kernel_env / "runs", kernel_env / "go"
    kernel = Kernel(kernel_env)
    try:
        msg_id = kernel.execute(SUBMIT_CELL.format(runs=str(runs), go=str(go)))
        text, msgs = kernel.read_until(msg_id, lambda text, _: "IDS" in text, timeout=90)
    finally:
        kernel.shutdown()  # the kernel process is killed
    kept_id, tied_id = text.split("IDS", 1)[1].split()[:2]
    assert not psutil.pid_exists(kernel.pid) or psutil.Process(kernel.pid).status() == psutil.STATUS_ZOMBIE

    tied = gpufleet.attach(tied_id, runs_dir=runs)
    try:
        assert tied.wait(60) == "cancelled", "a run submitted without detach ends with its kernel"
    except TimeoutError:
        pytest.fail(f"the run did not end with its kernel; its supervisor's log:\n"
                    f"{(tied.path / 'supervisor.log').read_text()}\nrecord: {tied.record()}")
    kept = gpufleet.attach(kept_id, runs_dir=runs)
    assert kept.status() == "running", kept.record()
    go.write_text("")
    assert kept.result(timeout=60) == [0, 10]
    assert "[rank 1] rank 1 went on" in kept.logs()
