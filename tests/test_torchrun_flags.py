"""torchrun's flags mean on `gpufleet run` what they mean to torchrun, and errors about a run
on a Ray cluster name its options as the surface used writes them.

What a user relies on:

- `--rdzv-backend c10d` (the rendezvous gpufleet's machines meet in) and `--rdzv-backend
  static` (the same, for a fixed number of machines) are accepted, spelled `--rdzv_backend`
  too; any other backend, or static with an elastic `--nnodes MIN:MAX`, is one line naming the
  value and the fix, exit 2, before anything starts.
- `--local-ranks-filter 1` shows local rank 1 of every machine: rank 1 on node 0, rank 3 on
  node 1 of a run of two machines of two ranks each. `--logs 1` still names global rank 1.
- An error on the way to a Ray cluster says `--remote` and `--ray-address` on the command
  line, `remote=True` and `ray_address=` in Python.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from support import PYTHON, prefixed_ranks, rank_lines
from test_cli_input import cli_env, explain, gpufleet, write

from gpufleet import ConfigError, cli, distributed

pytestmark = pytest.mark.timeout(120)

REPORTER = ("import os\nprint('world', os.environ['WORLD_SIZE'], 'rank', os.environ['RANK'], "
            "'local', os.environ['LOCAL_RANK'])\n")


def run(tmp_path, *args, timeout: float = 100):
    return gpufleet(*args, cwd=tmp_path, env=cli_env(tmp_path), timeout=timeout)


# ---------------------------------------------------------------------------- --rdzv-backend


def test_rdzv_backend_c10d_and_static_are_accepted_in_both_spellings(tmp_path):
    write(tmp_path / "reporter.py", REPORTER)
    proc = run(tmp_path, "run", "--standalone", "--rdzv_backend", "static", "--nproc-per-node", "2",
               "--no-tracking", "reporter.py")
    assert proc.returncode == 0, explain(proc)
    assert rank_lines(proc.stdout, 1) == ["world 2 rank 1 local 1"], explain(proc)
    for words in (["--rdzv-backend", "c10d"], ["--rdzv-backend=static"], ["--rdzv_backend=C10D"],
                  ["--rdzv-backend", "static", "--nnodes", "2", "--rdzv-endpoint", "h:1"]):
        args = cli._parser().parse_args(["run", *words, "reporter.py"])
        args.runs_dir = None
        cli._run_options(args)  # no error


@pytest.mark.parametrize("words, says", [
    (["--rdzv-backend", "etcd"], "--rdzv-backend etcd: the machines of a node run meet in a c10d "
                                 "rendezvous"),
    (["--rdzv_backend", "c10"], "(did you mean 'c10d'?)"),
    (["--rdzv-backend", "static", "--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:29400"],
     "--rdzv-backend static is a fixed number of machines, and --nnodes 1:2 an elastic one: give "
     "--nnodes 2, or --rdzv-backend c10d"),
])
def test_another_rdzv_backend_is_refused_before_anything_starts(tmp_path, words, says):
    write(tmp_path / "t.py", "print('must not run')\n")
    proc = run(tmp_path, "run", *words, "t.py")
    assert proc.returncode == 2, explain(proc)
    (line,) = proc.stderr.strip().splitlines()
    assert says in line, explain(proc)
    assert "must not run" not in proc.stdout


# ---------------------------------------------------------------------------- --local-ranks-filter


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# two machines of two ranks each, on this one
def test_local_ranks_filter_shows_that_local_rank_of_every_machine(tmp_path):
    write(tmp_path / "reporter.py", REPORTER)
    endpoint = f"127.0.0.1:{_free_port()}"
    machines = [subprocess.Popen(
        [PYTHON, "-m", "gpufleet", "run", "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint",
         endpoint, "--nproc-per-node", "2", "--local-ranks-filter", "1", "--no-tracking", "reporter.py"],
        cwd=tmp_path, env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)]
    try:
        outputs = [m.communicate(timeout=100) for m in machines]
    finally:
        for m in machines:
            m.kill()
            m.wait()
    for node, (machine, (out, err)) in enumerate(zip(machines, outputs)):
        assert machine.returncode == 0, f"node {node}:\n{out}{err}"
    (out0, err0), (out1, err1) = outputs
    assert rank_lines(out0, 1) == ["world 4 rank 1 local 1"] and prefixed_ranks(out0) == {1}, out0 + err0
    assert rank_lines(out1, 3) == ["world 4 rank 3 local 1"] and prefixed_ranks(out1) == {3}, out1 + err1


def test_local_ranks_filter_names_ranks_this_machine_has_and_no_ray_run(tmp_path):
    write(tmp_path / "t.py", "print('must not run')\n")
    proc = run(tmp_path, "run", "--nproc-per-node", "2", "--local-ranks-filter", "2", "t.py")
    assert proc.returncode == 2, explain(proc)
    assert "--local-ranks-filter 2 names local ranks the run does not have: it has 2 ranks on this " \
           "machine, 0 to 1" in proc.stderr, explain(proc)
    proc = run(tmp_path, "run", "--remote", "--local-ranks-filter", "0", "t.py")
    assert proc.returncode == 2, explain(proc)
    assert "--local-ranks-filter 0 names local ranks, each machine's own, which a run on a Ray " \
           "cluster does not tell apart: give global ranks instead, e.g. --logs 0,8" in proc.stderr, explain(proc)
    assert "must not run" not in proc.stdout


# ---------------------------------------------------------------------------- the Ray path


def test_ray_errors_say_remote_as_the_command_line_writes_it(tmp_path, monkeypatch, capfd):
    write(tmp_path / "t.py", "print('must not run')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPUFLEET_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(sys.modules, "ray", None)  # as where Ray is not installed: import fails
    assert cli.main(["run", "--remote", "--gpus", "1", "t.py"]) == 2
    err = capfd.readouterr().err
    assert "--remote runs on Ray, which is not installed here" in err, err
    assert "pip install 'gpufleet[ray]', or drop --remote to run on this machine" in err, err
    assert "remote=" not in err, err

    with pytest.raises(ConfigError, match=r"remote=True runs on Ray, which is not installed here .* "
                                          r"or pass remote=False to run on this machine"):
        distributed(remote=True, gpus=1)(lambda: None).distributed()


def test_ray_errors_say_ray_address_as_the_command_line_writes_it(tmp_path, monkeypatch, capfd):
    write(tmp_path / "t.py", "print('must not run')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPUFLEET_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    gone = f"http://127.0.0.1:{_free_port()}"
    assert cli.main(["run", "--remote", "--ray-address", gone, "t.py"]) == 2
    err = capfd.readouterr().err
    assert f"cannot reach the Ray dashboard at {gone}" in err and "check --ray-address or RAY_ADDRESS" in err, err
    assert "ray_address=" not in err, err

    assert cli.main(["runs", "--ray-address", gone]) == 0  # this machine's runs, and a warning
    err = capfd.readouterr().err
    assert f"cannot reach Ray Jobs at {gone}" in err, err
    assert "give the head's dashboard address (--ray-address http://HEAD:8265, or RAY_ADDRESS)" in err, err
    assert "ray_address=" not in err, err
