"""Small pieces of the seed API: runtime.get_replica_rank(), gpufleet.GPUType and
runtime.main_process_first(), on real gloo ranks where ranks are involved.

What a user relies on:

- `get_replica_rank(shard_size)` is the index of the model copy a rank holds (a part of):
  its global rank under DDP, 0 on every rank of a run sharded over all ranks, the node rank
  when each node holds one copy; 0 in a direct call; a shard size that does not divide the
  run is an error naming it and the fix.
- `GPUType.H100 == "H100"`; a member is accepted wherever `gpu_type` is (decorator,
  `.options()`, `gpufleet run --gpu-type`, workload files) and gets the same checks and the
  same messages as the string.
- `with runtime.main_process_first():` runs the block on one rank (local rank 0, or global
  rank 0 with local=False) before the others start it; a failure in the block on the first
  rank stops the others at once, without running it, instead of leaving them waiting; a
  failure on another rank does not leave the first waiting either. Before setup() in a run it
  is an error; outside a run it just runs the block.
"""

from __future__ import annotations

import time

import pytest

import gpufleet
from gpufleet import ConfigError, GPUType, RunFailedError, distributed, runtime
from gpufleet.launchers import hardware
from gpufleet.options import RunOptions

pytestmark = pytest.mark.timeout(120)

FAILS_WITHIN_S = 30  # a failure in the block ends the run this fast; a hang would wait for timeout=


def write_event(path, text: str) -> None:
    """One line appended in one write (O_APPEND): lines of several ranks never interleave."""
    import os

    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (text + "\n").encode())
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- no processes


def test_replica_rank_in_a_direct_call_is_that_of_a_world_of_one():
    assert runtime.get_replica_rank() == 0
    assert runtime.get_replica_rank(8) == 0  # one process holds the one copy
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="shard_size"):
            runtime.get_replica_rank(bad)


def test_main_process_first_outside_a_run_just_runs_the_block():
    ran = []
    with runtime.main_process_first():
        ran.append("local")
    with runtime.main_process_first(local=False):
        ran.append("global")
    assert ran == ["local", "global"]
    with pytest.raises(ValueError, match="inside"):
        with runtime.main_process_first():
            raise ValueError("inside")


def test_gpu_type_enum_is_its_string_everywhere(tmp_path):
    assert gpufleet.GPUType is GPUType
    assert GPUType.H100 == "H100" and isinstance(GPUType.H100, str) and f"{GPUType.A10}" == "A10"
    for member in GPUType:
        options = RunOptions.create(gpu_type=member)
        assert options.gpu_type == member.value and type(options.gpu_type) is str
        assert RunOptions.create(gpus=1).replace(gpu_type=member).gpu_type == member.value
    # Matched as the string is: a whole word of the driver's name, ignoring case.
    hardware.check_gpu_type(GPUType.H100, ("NVIDIA H100 80GB HBM3",))
    with pytest.raises(ConfigError) as enum_error:
        hardware.check_gpu_type(GPUType.A10, ("NVIDIA A100-SXM4-40GB",))
    with pytest.raises(ConfigError) as string_error:
        hardware.check_gpu_type("A10", ("NVIDIA A100-SXM4-40GB",))
    assert str(enum_error.value) == str(string_error.value)
    assert "gpu_type='A10'" in str(enum_error.value)

    # The command line's flag and a workload file's field take the enum's names as text.
    from gpufleet import flags
    from gpufleet.cli import _parser
    from gpufleet.runs import workload

    args = _parser().parse_args(["run", "--gpu-type", GPUType.H200.value, "train.py"])
    assert RunOptions.create(**flags.options_from(args)[0]).gpu_type == GPUType.H200
    path = tmp_path / "w.yaml"
    path.write_text(f"command: [python, -c, pass]\ngpu_type: {GPUType.L40S.value}\n")
    assert RunOptions.create(**workload.load(path).options).gpu_type == GPUType.L40S


def test_gpu_type_enum_gets_the_strings_checks_before_anything_starts(runs_dir, no_leftover_processes):
    def train():
        return runtime.get_global_rank()

    messages = []
    for value in (GPUType.T4, "T4"):  # no GPU here, or not a T4: refused either way
        for fn in (distributed(gpu_type=value, runs_dir=runs_dir)(train),
                   distributed(runs_dir=runs_dir)(train).options(gpu_type=value)):
            with pytest.raises(ConfigError) as info:
                fn.distributed()
            messages.append(str(info.value))
    assert len(set(messages)) == 1, messages
    assert "gpu_type='T4'" in messages[0] and "GPUType" not in messages[0]
    assert not no_leftover_processes.started_since()


# ---------------------------------------------------------------------------- ranks


def test_replica_ranks_and_main_process_first_order(runs_dir, tmp_path):
    events = tmp_path / "events"

    @distributed(gpus=4, runs_dir=runs_dir, timeout=90)
    def train(events):
        import time

        from gpufleet import GpufleetError, runtime

        try:
            with runtime.main_process_first():
                pass
            before_setup = "no error"
        except GpufleetError as exc:
            before_setup = str(exc)
        runtime.setup(timeout=30)
        rank = runtime.get_global_rank()
        try:
            runtime.get_replica_rank(3)
            uneven = "no error"
        except ConfigError as exc:
            uneven = str(exc)
        for local in (True, False):
            with runtime.main_process_first(local=local):
                write_event(events, f"{local} enter {rank}")
                if rank == 0:
                    time.sleep(0.5)  # the others must wait for this, however long it takes
                write_event(events, f"{local} leave {rank}")
        return {
            "ddp": runtime.get_replica_rank(),
            "pairs": runtime.get_replica_rank(2),
            "fsdp": runtime.get_replica_rank(runtime.get_world_size()),
            "per_node": runtime.get_replica_rank(runtime.get_local_world_size()),
            "node": runtime.get_node_rank(),
            "before_setup": before_setup,
            "uneven": uneven,
        }

    results = train.distributed(events)
    assert [r["ddp"] for r in results] == [0, 1, 2, 3]
    assert [r["pairs"] for r in results] == [0, 0, 1, 1]
    assert [r["fsdp"] for r in results] == [0, 0, 0, 0]
    assert [r["per_node"] for r in results] == [r["node"] for r in results] == [0, 0, 0, 0]
    for r in results:
        assert "runtime.setup()" in r["before_setup"]
        assert "shard_size=3" in r["uneven"] and "get_local_world_size()" in r["uneven"]
    lines = events.read_text().splitlines()
    for local in ("True", "False"):
        mine = [line.split(" ", 1)[1] for line in lines if line.startswith(local + " ")]
        assert mine[:2] == ["enter 0", "leave 0"], mine  # rank 0 done before anyone else starts
        assert sorted(mine[2:]) == sorted(f"{what} {r}" for r in (1, 2, 3) for what in ("enter", "leave"))


def test_a_failure_in_the_first_process_stops_the_others_at_once(runs_dir, tmp_path):
    events = tmp_path / "events"

    @distributed(gpus=2, runs_dir=runs_dir, timeout=90)
    def train(events):
        from gpufleet import runtime

        runtime.setup(timeout=60)
        with runtime.main_process_first(local=False):
            write_event(events, f"ran {runtime.get_global_rank()}")
            if runtime.get_global_rank() == 0:
                raise FileNotFoundError("no such dataset: /data/imdb")
        return "unreachable"

    started = time.monotonic()
    with pytest.raises(RunFailedError) as info:
        train.distributed(events)
    assert time.monotonic() - started < FAILS_WITHIN_S
    error = info.value
    root = error.failures[0]
    assert (root.rank, root.collateral) == (0, False)
    assert "FileNotFoundError: no such dataset" in root.summary
    echo = next(f for f in error.failures if f.rank == 1)
    assert echo.collateral, "rank 1's error is reported as the echo of rank 0's"
    assert "rank 0 failed inside runtime.main_process_first()" in echo.summary
    assert events.read_text().splitlines() == ["ran 0"], "rank 1 never ran the block"


def test_a_failure_in_another_process_does_not_leave_the_first_waiting(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir, timeout=90)
    def train():
        from gpufleet import runtime

        runtime.setup(timeout=60)
        with runtime.main_process_first():
            if runtime.get_global_rank() == 1:
                raise KeyError("tokenizer.json")
        return "unreachable"

    started = time.monotonic()
    with pytest.raises(RunFailedError) as info:
        train.distributed()
    assert time.monotonic() - started < FAILS_WITHIN_S
    root = info.value.failures[0]
    assert root.rank == 1 and "KeyError" in root.summary and "tokenizer.json" in root.summary
    others = [f for f in info.value.failures if f.rank == 0]
    assert others and others[0].collateral and "rank 1 failed" in others[0].summary
