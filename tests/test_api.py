"""The decorator's surface and bad input: everything here fails (or passes) before any process
starts, so these tests are fast."""

from __future__ import annotations

import functools
import inspect
import json
import subprocess
import threading
import time

import pytest

import gpufleet
from gpufleet import (ConfigError, GpufleetError, PayloadError, RunFailedError, RunTimeoutError,
                      distributed, runtime)
from support import HEAVY_MODULES, PYTHON, run_folders

pytestmark = pytest.mark.timeout(30)

# Rejecting bad input launches nothing (the tests check that no process and no run folder
# appear), so it takes well under what one call's start takes; the bound allows for a machine
# loaded by other suites, where even importing CUDA's bindings to count GPUs takes seconds.
FAST_FAIL_S = 10.0

GLOBAL_LOCK = threading.Lock()


def train(epochs: int, lr: float = 1e-3, *, tag: str | None = None) -> dict:
    """Train for a few epochs."""
    return {"epochs": epochs, "lr": lr, "tag": tag}


def test_error_hierarchy():
    assert issubclass(ConfigError, GpufleetError) and issubclass(ConfigError, ValueError)
    assert issubclass(PayloadError, GpufleetError) and issubclass(PayloadError, TypeError)
    assert issubclass(RunFailedError, GpufleetError) and issubclass(RunFailedError, RuntimeError)
    assert issubclass(RunTimeoutError, RunFailedError) and issubclass(RunTimeoutError, TimeoutError)
    for name in ("GpufleetError", "ConfigError", "PayloadError", "RunFailedError",
                 "RunTimeoutError", "distributed", "runtime"):
        assert hasattr(gpufleet, name)


@pytest.mark.parametrize("bare", [True, False], ids=["@distributed", "@distributed(...)"])
def test_decorated_function_keeps_name_doc_and_signature(bare):
    wrapped = distributed(train) if bare else distributed(gpus=2, timeout=60)(train)

    assert type(wrapped).__name__ == "DistributedFunction"
    assert wrapped.__name__ == "train"
    assert wrapped.__doc__ == "Train for a few epochs."
    assert inspect.signature(wrapped) == inspect.signature(train)
    assert callable(wrapped.distributed)
    assert wrapped(2, tag="x") == {"epochs": 2, "lr": 1e-3, "tag": "x"}  # direct call
    copy = wrapped.options(timeout=5)
    assert copy is not wrapped and copy.__name__ == "train"
    assert inspect.signature(copy) == inspect.signature(train)


@pytest.mark.parametrize(
    "options, words",
    [
        ({"gpus": 0}, ["gpus", "0"]),
        ({"gpus": -1}, ["gpus", "-1"]),
        ({"gpus": "2"}, ["gpus", "'2'"]),
        ({"gpus": 2.5}, ["gpus", "2.5"]),
        ({"gpu": 2}, ["gpu", "gpus", "gpu_type", "remote", "timeout"]),  # lists valid options
        ({"remote": "slurm"}, ["remote", "'slurm'", "'ray'"]),
        ({"placement": "spread"}, ["placement='spread'", "remote=True"]),  # unused locally
        ({"remote": True, "warm": True}, ["warm=True", "remote=True"]),
        ({"remote": True, "placement": "everywhere"}, ["placement", "'pack'", "'spread'"]),
        ({"remote": True, "pip": "numpy"}, ["pip=", "list of requirements"]),
        ({"remote": True, "runtime_env": {"pip": ["x"]}}, ["runtime_env", "pip=[...]"]),
        ({"remote": True, "placement_timeout": 0}, ["placement_timeout", "0"]),
        ({"gpu_type": "H100"}, ["H100"]),  # no GPU here: must say what was found
        ({"timeout": -5}, ["timeout", "-5"]),
        ({"logs": "everything"}, ["logs", "everything"]),
        ({"gpus": 2, "logs": [5]}, ["logs", "5"]),  # no rank 5 in a world of 2
        ({"gpus": (3, 2), "remote": True}, ["gpus=(3, 2)", "no more than MAX"]),  # elastic sizes
        ({"gpus": (0, 2), "remote": True}, ["gpus=(0, 2)", "at least 1"]),
        ({"gpus": (1, 2, 3), "remote": True}, ["gpus=(1, 2, 3)", "(MIN, MAX)"]),
        ({"gpus": (1, 2)}, ["gpus=(1, 2)", "remote=True", "gpus=2", "nnodes=(1, 2)"]),  # Ray's only
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else None,
)
def test_bad_options_raise_config_error_before_anything_starts(options, words, runs_dir,
                                                                no_leftover_processes):
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        distributed(runs_dir=runs_dir, **options)(train).distributed(1)
    elapsed = time.monotonic() - started
    text = str(info.value)

    assert isinstance(info.value, ValueError)
    for word in words:
        assert word in text, f"{word!r} missing from: {text}"
    assert elapsed < FAST_FAIL_S
    assert not run_folders(runs_dir), "no run may start for bad options"
    assert not no_leftover_processes.started_since(), "no process may start for bad options"


def test_gpu_type_without_gpu_says_none_was_found(runs_dir):
    with pytest.raises(ConfigError) as info:
        distributed(gpu_type="H200", runs_dir=runs_dir)(train).distributed(1)
    text = str(info.value).lower()
    assert "no gpu" in text or "0 gpu" in text or "found" in text, text


def test_a_cluster_function_runs_here_with_remote_false():
    """Switching a function between the cluster and this machine changes one option."""
    cluster = distributed(remote=True, gpus=16, placement="spread")(train)
    here = cluster.options(remote=False, gpus=2)
    assert cluster.run_options.remote == "ray"
    assert (here.run_options.remote, here.run_options.placement) == (False, "spread")


def test_options_with_unknown_name_lists_valid_ones():
    with pytest.raises(ConfigError) as info:
        distributed(train).options(gpuz=2)
    assert "gpuz" in str(info.value) and "gpus" in str(info.value)


@pytest.mark.parametrize("target", [42, "train"], ids=["int", "str"])
@pytest.mark.parametrize("form", ["bare", "with options"])
def test_non_callable_raises_config_error(target, form):
    with pytest.raises(ConfigError) as info:
        distributed(target) if form == "bare" else distributed(gpus=2)(target)
    assert repr(target) in str(info.value) or type(target).__name__ in str(info.value)


async def _coroutine_fn():
    return 1


async def _async_generator_fn():
    yield 1


def _generator_fn():
    yield 1


class _Scaled:
    async def __call__(self):
        return 1


@pytest.mark.parametrize(
    "target, words",
    [
        (_coroutine_fn, ["async def", "asyncio.run"]),
        (_async_generator_fn, ["async def", "asyncio.run"]),
        (_generator_fn, ["generator", "return a list"]),
        (_Scaled(), ["async def", "asyncio.run"]),  # an instance whose __call__ is async
        (functools.partial(_coroutine_fn), ["async def", "asyncio.run"]),
    ],
    ids=["async def", "async generator", "generator", "async __call__", "partial of async"],
)
def test_functions_no_rank_could_run_are_refused_at_decoration(target, words, runs_dir,
                                                               no_leftover_processes):
    with pytest.raises(ConfigError) as info:
        distributed(gpus=2, runs_dir=runs_dir)(target)
    for word in words:
        assert word in str(info.value), str(info.value)
    assert not run_folders(runs_dir) and not no_leftover_processes.started_since()


def _assert_nothing_started(runs_dir, sampler, elapsed):
    assert elapsed < FAST_FAIL_S
    assert not run_folders(runs_dir), "no run may start when the payload cannot be pickled"
    assert not sampler.started_since(), "no process may start when the payload cannot be pickled"


def test_unpicklable_argument_is_named_before_launch(runs_dir, no_leftover_processes):
    @distributed(gpus=2, runs_dir=runs_dir)
    def uses(data, guard_lock=None):
        return data

    started = time.monotonic()
    with pytest.raises(PayloadError) as info:
        uses.distributed([1, 2, 3], guard_lock=threading.Lock())
    text = str(info.value)

    assert isinstance(info.value, TypeError)
    assert "guard_lock" in text, text
    assert "lock" in text.lower(), text
    _assert_nothing_started(runs_dir, no_leftover_processes, time.monotonic() - started)


def test_unpicklable_positional_argument_is_named_before_launch(runs_dir, no_leftover_processes):
    @distributed(gpus=2, runs_dir=runs_dir)
    def uses(data, guard_lock):
        return data

    started = time.monotonic()
    with pytest.raises(PayloadError) as info:
        uses.distributed([1, 2, 3], threading.Lock())
    text = str(info.value)

    assert "guard_lock" in text or "args[1]" in text or "argument 1" in text, text
    _assert_nothing_started(runs_dir, no_leftover_processes, time.monotonic() - started)


def test_unpicklable_captured_global_is_named_before_launch(runs_dir, no_leftover_processes):
    @distributed(gpus=2, runs_dir=runs_dir)
    def uses_global():
        with GLOBAL_LOCK:
            return runtime.get_global_rank()

    started = time.monotonic()
    with pytest.raises(PayloadError) as info:
        uses_global.distributed()
    text = str(info.value)

    assert "GLOBAL_LOCK" in text, text
    _assert_nothing_started(runs_dir, no_leftover_processes, time.monotonic() - started)


def test_unpicklable_closure_variable_is_named_before_launch(runs_dir, no_leftover_processes):
    shared_lock = threading.Lock()

    @distributed(gpus=2, runs_dir=runs_dir)
    def uses_closure():
        with shared_lock:
            return runtime.get_global_rank()

    started = time.monotonic()
    with pytest.raises(PayloadError) as info:
        uses_closure.distributed()

    assert "shared_lock" in str(info.value), str(info.value)
    _assert_nothing_started(runs_dir, no_leftover_processes, time.monotonic() - started)


def test_import_gpufleet_stays_light(tmp_path):
    code = "import json, sys, gpufleet; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, check=True).stdout
    loaded = {name.split(".")[0] for name in json.loads(out.strip().splitlines()[-1])}

    heavy = loaded & set(HEAVY_MODULES)
    assert "gpufleet" in loaded
    assert not heavy, f"import gpufleet pulled in {sorted(heavy)}"
