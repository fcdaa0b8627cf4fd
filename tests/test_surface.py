"""The public surface, frozen: a change here is a change users see, so it must be deliberate."""

import inspect

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
    assert sorted(commands) == ["cancel", "completion", "logs", "prune", "run", "runs", "schema", "status",
                               "submit", "template", "ui"]


def test_runtime_functions():
    assert sorted(runtime.__all__) == [
        "get_attempt", "get_global_rank", "get_local_rank", "get_local_world_size",
        "get_node_rank", "get_replica_rank", "get_world_size", "heartbeat", "is_main_process",
        "main_process_first", "setup", "should_stop", "step",
    ]
    assert list(inspect.signature(runtime.setup).parameters) == ["backend", "timeout"]
    assert list(inspect.signature(runtime.step).parameters) == ["samples", "tokens", "total"]


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
