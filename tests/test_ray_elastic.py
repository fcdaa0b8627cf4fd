"""Elastic size on Ray (``gpus=(min, max)`` with ``remote=True``), on a real multi-node Ray
cluster on this machine: the cluster of tests/test_ray.py (a head and two nodes of two logical
GPUs each), started for this module. A run starts with the GPUs free, shrinks when a node is
lost, grows when a node joins, and resumes from its checkpoint at each new size; none of these
restarts counts as a retry (``max_retries=0`` throughout). "Another job" holding GPUs is a
placement group the test makes.

The bad sizes are refused before anything starts, without a cluster.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from gpufleet import ConfigError, distributed, runtime

ray = pytest.importorskip("ray")

import test_ray  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402
from test_ray import GPUS_PER_NODE, add_gpu_node, layout  # noqa: E402

# test_ray's fixtures: the same cluster (this module's own instance), the same checks after each test
cluster, released, working_dir = test_ray.cluster, test_ray.released, test_ray.working_dir

STEPS, GLOBAL_BATCH, EVERY = 50, 8, 5


def attempts(last: Path) -> list[Path]:
    """Every attempt folder of the run whose latest attempt is ``last`` (``fn.last_run``)."""
    return sorted(last.parent.glob("attempt-*"), key=lambda p: int(p.name.split("-")[1]))


def phases(attempt: Path) -> dict:
    return json.loads((attempt / "cluster.json").read_text())["phases"]


def wait_for(what, timeout: float, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        time.sleep(every)
    return None


def logged(fn, pattern: str) -> bool:
    """A line of the run's latest attempt matches (the ranks' logs, mirrored here)."""
    run = fn.last_run
    return run is not None and any(re.search(pattern, log.read_text(errors="replace"))
                                   for log in run.glob("logs/rank-*.log"))


def train(ckpt_root: str):
    """DDP over gloo: each rank takes x[rank::world] of a global batch made from the step, so
    every world size takes the same steps; a checkpoint every EVERY steps, and when asked to
    stop. Slow in its first attempt and while small: time for the test to take a node away
    and to give one back."""
    import torch
    import torch.distributed as dist

    from gpufleet.checkpoint import Checkpointer

    runtime.setup(timeout=60)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    with Checkpointer(ckpt_root, async_save=False, keep=2) as ckpt:
        start = ckpt.restore(model, opt)
        print(f"resumed at {start} with {world} ranks", flush=True)
        for step in range(start, STEPS):
            x = torch.randn(GLOBAL_BATCH, 4, generator=torch.Generator().manual_seed(step))
            y = x.sum(1, keepdim=True)
            loss = torch.nn.functional.mse_loss(ddp(x[rank::world]), y[rank::world])
            opt.zero_grad()
            loss.backward()
            opt.step()
            stop = runtime.should_stop()  # a SIGTERM, or a stop to grow: save, then return
            if stop or (step + 1) % EVERY == 0:
                ckpt.save(step + 1, model, opt)
            print(f"step {step + 1} world {world}", flush=True)
            if stop:
                break
            time.sleep(0.6 if world < 4 or runtime.get_attempt() == 0 else 0)
    return {"world": world, "attempt": runtime.get_attempt(),
            "weights": {k: v.clone() for k, v in model.state_dict().items()}}


def uninterrupted() -> dict:
    """The same steps in one process, on the whole global batch each step."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        x = torch.randn(GLOBAL_BATCH, 4, generator=torch.Generator().manual_seed(step))
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.state_dict()


# ---------------------------------------------------------------------------- runs


@pytest.mark.timeout(120)
def test_an_elastic_run_starts_with_the_gpus_that_are_free(cluster, runs_dir, capsys):
    held = placement_group([{"GPU": 1, "CPU": 1}] * GPUS_PER_NODE, strategy="STRICT_PACK")
    ray.get(held.ready(), timeout=30)  # another job holds one node's GPUs: 2 of 4 are free

    def where():
        return runtime.get_global_rank(), runtime.get_world_size()

    try:
        fn = distributed(gpus=(2, 4), remote=True, runs_dir=runs_dir, timeout=90, tracking=False)(where)
        results = fn.distributed()
    finally:
        remove_placement_group(held)
    assert results == [(0, 2), (1, 2)]
    assert len(attempts(fn.last_run)) == 1
    assert "2 ranks on 1 node of the Ray cluster" in capsys.readouterr().err


@pytest.mark.timeout(480)
def test_an_elastic_run_shrinks_when_a_node_is_lost_grows_when_one_joins_and_ends_as_an_uninterrupted_run(
        cluster, runs_dir, tmp_path, capsys):
    held = placement_group([{"GPU": 1, "CPU": 1}] * GPUS_PER_NODE, strategy="STRICT_PACK")
    ray.get(held.ready(), timeout=30)  # another job holds one node of the module's
    doomed = add_gpu_node(cluster)  # the run gets the other and this one, which it loses
    fn = distributed(gpus=(2, 4), remote=True, runs_dir=runs_dir, timeout=400, max_retries=0,
                     tracking=False)(train)
    events: dict = {}
    outcome: dict = {}

    def call():  # in a thread: Ray adds nodes from the main thread only
        try:
            outcome["results"] = fn.distributed(str(tmp_path / "ckpt"))
        except BaseException as exc:
            outcome["error"] = exc

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    try:
        if wait_for(lambda: logged(fn, r"step ([6-9]|1[0-9]) world 4"), timeout=120):  # after a checkpoint
            cluster.remove_node(doomed, allow_graceful=False)
            events["lost"] = time.time()
            if wait_for(lambda: logged(fn, r"step \d+ world 2"), timeout=90):
                events["joined"] = time.time()
                events["node"] = add_gpu_node(cluster)
        caller.join(360)
        assert not caller.is_alive(), "the call did not end within its timeout"
    finally:
        remove_placement_group(held)
        for node in (doomed, events.get("node")):
            if node is not None and node in cluster.worker_nodes:
                cluster.remove_node(node)
    if "error" in outcome:
        raise outcome["error"]
    results = outcome["results"]
    assert "lost" in events and "node" in events, events
    runs = attempts(fn.last_run)
    sizes = [len(layout(run)) for run in runs]
    assert sizes[0] == 4 and sizes[-1] == 4 and 2 in sizes, sizes
    assert {p["node_id"] for p in layout(runs[0])} >= {doomed.node_id}
    shrunk = next(run for run in runs if len(layout(run)) == 2)
    assert doomed.node_id not in {p["node_id"] for p in layout(shrunk)}
    assert events["node"].node_id in {p["node_id"] for p in layout(runs[-1])}, "it grew onto the new node"
    shrinking, growing = phases(shrunk), phases(runs[-1])
    with capsys.disabled():  # the numbers docs/design.md quotes (pytest -s shows them)
        print(f"node lost -> launch at the new size {shrinking['started'] - events['lost']:.1f} s, "
              f"-> its ranks started {shrinking['ranks_started'] - events['lost']:.1f} s; node joined -> "
              f"grown ranks started {growing['ranks_started'] - events['joined']:.1f} s")
    resumed = [int(m) for run in runs
               for m in re.findall(r"resumed at (\d+) with", (run / "logs/rank-0.log").read_text())]
    assert resumed[0] == 0 and all(b > 0 for b in resumed[1:]), resumed  # from the checkpoint, each time
    err = capsys.readouterr().err
    assert "lost with its node" in err or "its Ray actor is gone" in err, err
    assert "stopped to grow" in err, err
    assert err.count("the run's machines changed; starting every rank again at the new size") == len(runs) - 1
    assert "of 1 failed" not in err  # no retry: max_retries=0 had none to give
    assert [r["world"] for r in results] == [4] * 4
    for name, value in uninterrupted().items():
        for result in results:
            assert result["weights"][name].allclose(value, rtol=1e-5, atol=1e-6), name


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("gpus, words", [
    ((3, 2), ["gpus=(3, 2)", "MIN at least 1 and no more than MAX"]),
    ((0, 2), ["gpus=(0, 2)", "MIN at least 1"]),
    ("2:x", ["gpus='2:x'", "MIN:MAX"]),
    ((1, 2, 3), ["gpus=(1, 2, 3)", "(MIN, MAX)"]),
    ((1.5, 2), ["gpus=(1.5, 2)", "(MIN, MAX)"]),
])
def test_a_bad_elastic_size_is_refused_before_anything_starts(gpus, words, runs_dir):
    with pytest.raises(ConfigError) as info:
        distributed(gpus=gpus, remote=True, runs_dir=runs_dir)(lambda: None)
    for word in words:
        assert word in str(info.value), str(info.value)
    assert not runs_dir.exists()


def test_an_elastic_size_without_remote_names_the_fix(runs_dir):
    with pytest.raises(ConfigError) as info:
        distributed(gpus=(1, 2), runs_dir=runs_dir)(lambda: None)
    text = str(info.value)
    for word in ("gpus=(1, 2)", "remote=True", "gpus=2", "nnodes=(1, 2)"):
        assert word in text, text
    assert not runs_dir.exists()
