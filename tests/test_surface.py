"""The public surface, frozen: a change here is a change users see, so it must be deliberate."""

import inspect

import pytest

import gpufleet
from gpufleet import data, runtime


def test_top_level_names():
    assert sorted(gpufleet.__all__) == [
        "ConfigError", "DistributedFunction", "GPUType", "GpufleetError", "PayloadError", "Pool",
        "RankFailure", "Run", "RunCancelledError", "RunFailedError", "RunHangError",
        "RunPreemptedError", "RunTimeoutError", "Sweep", "Trial", "attach", "distributed",
        "log_metrics", "pool", "runs", "runtime", "sweep",
    ]


def test_decorator_options():
    from gpufleet.options import option_names

    assert option_names() == ["gpus", "gpu_type", "remote", "timeout", "logs", "env", "runs_dir",
                              "max_retries", "no_retry", "hang_timeout", "grace_period",
                              "show_timings", "step_telemetry", "straggler_threshold",
                              "collapse_lines", "tracking", "join_mlflow_run", "warm", "ray_address", "placement",
                              "placement_timeout", "pip", "runtime_env", "name", "detach",
                              "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id"]


def test_run_handle_and_command_line():
    assert [m for m in dir(gpufleet.Run) if not m.startswith("_")] == [
        "cancel", "done", "id", "logs", "name", "path", "progress", "record", "result", "status", "wait",
    ]
    from gpufleet.cli import _parser

    commands = _parser()._subparsers._group_actions[0].choices
    assert sorted(commands) == ["cancel", "completion", "estimate", "logs", "prune", "run", "runs", "schema",
                               "status", "submit", "template", "ui"]


def test_runtime_functions():
    assert sorted(runtime.__all__) == [
        "flops", "get_attempt", "get_global_rank", "get_local_rank", "get_local_world_size",
        "get_node_rank", "get_replica_rank", "get_world_size", "heartbeat", "is_main_process",
        "main_process_first", "setup", "should_stop", "step",
    ]
    assert list(inspect.signature(runtime.setup).parameters) == ["backend", "timeout"]
    assert list(inspect.signature(runtime.step).parameters) == ["samples", "tokens", "total"]
    assert list(inspect.signature(runtime.flops).parameters) == ["per_token", "per_sample", "per_step", "count"]


def test_data_names():
    assert sorted(data.__all__) == ["FileDataset", "ResumableLoader", "loader"]


def test_strategy_and_checkpoint_names():
    from gpufleet import checkpoint, strategies

    assert sorted(strategies.__all__) == [
        "DDP", "FSDP", "NAMES", "Prepared", "ZeRO", "prepare", "resolve",
    ]
    assert strategies.NAMES == ("ddp", "fsdp", "zero1", "zero2", "zero3")
    assert checkpoint.__all__ == ["Checkpointer"]
    assert list(inspect.signature(checkpoint.Checkpointer).parameters) == [
        "root", "keep", "async_save", "every_steps", "every", "keep_best",
    ]


def test_memory_names():
    from gpufleet import memory

    assert sorted(memory.__all__) == ["Estimate", "GPUS", "MemoryCheckError", "MicroBatchFloorError",
                                      "MicroBatches", "estimate"]
    assert list(inspect.signature(memory.MicroBatches).parameters) == [
        "target", "micro_batch", "optimizer", "scheduler", "shrink", "overlap_sync", "backward",
    ]
    assert [n for n in dir(memory.MicroBatches) if not n.startswith("_")] == [
        "accumulate", "close", "load_state_dict", "state_dict", "step",
    ]


def test_integration_names():
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    from gpufleet.integrations import huggingface, lightning

    assert huggingface.__all__ == ["GpufleetCallback", "last_checkpoint", "micro_batches"]
    assert lightning.__all__ == ["GpufleetCallback", "micro_batches"]
    assert list(inspect.signature(huggingface.micro_batches).parameters) == ["trainer", "micro_batch", "shrink"]
    assert list(inspect.signature(lightning.micro_batches).parameters) == [
        "module", "micro_batch", "shrink", "gradient_clip_val", "gradient_clip_algorithm",
    ]


# ---------------------------------------------------------------------------- behind the names
# The names above are frozen; the tests below check that what they name does what a user
# calls it for.


def test_the_run_handle_does_what_each_of_its_names_says(runs_dir):
    from gpufleet import attach, distributed, runs

    @distributed(gpus=2, runs_dir=runs_dir, tracking=False)
    def ranks(tag):
        print("hello from", runtime.get_global_rank(), flush=True)
        return (tag, runtime.get_global_rank(), runtime.get_world_size(), runtime.is_main_process())

    run = ranks.submit("t")
    assert run.wait(timeout=100) == "succeeded" and run.done() and run.status() == "succeeded"
    assert run.result() == [("t", 0, 2, True), ("t", 1, 2, False)]
    assert run.name == "ranks" and run.id.startswith("ranks-") and run.path == runs_dir / run.id
    assert run.record()["status"] == "succeeded" and run.record()["gpus"] == 2
    assert "[rank 1] hello from 1" in run.logs() and run.logs(rank=0).strip() == "hello from 0"
    assert run.progress() == (None, {})  # no gpufleet.log_metrics in this run
    assert run.cancel() == "succeeded", "cancelling an ended run changes nothing"
    assert attach(run.id, runs_dir).result() == run.result()
    assert [r.id for r in runs(runs_dir)] == [run.id]


def test_every_command_answers_its_help(capsys):
    import pytest

    from gpufleet.cli import _parser, main

    for command in _parser()._subparsers._group_actions[0].choices:
        with pytest.raises(SystemExit) as exited:
            main([command, "--help"])
        assert exited.value.code == 0, command
        assert f"usage: gpufleet {command}" in capsys.readouterr().out, command


def test_a_direct_call_sees_one_process_through_the_runtime_functions():
    from gpufleet import distributed

    @distributed(gpus=2)
    def where():
        return (runtime.get_global_rank(), runtime.get_local_rank(), runtime.get_world_size(),
                runtime.get_local_world_size(), runtime.get_node_rank(), runtime.is_main_process(),
                runtime.get_attempt(), runtime.should_stop())

    assert where() == (0, 0, 1, 1, 0, True, 0, False)  # undistributed, in this process
