"""How the suite is spread over pytest-xdist's workers, which tests make the inner loop, and
what it says of skipped tests.

Workers (`pytest -n 2 --dist loadfile --no-loadscope-reorder`, the README's command) take
whole modules, so that what a module builds once (a network of namespaces, a Slurm, a Ray
cluster, the docs site, a wheel) is built once, in one worker. Modules are handed out in the
order of HEAVY_FIRST, then the rest (``--no-loadscope-reorder`` keeps this order; xdist's own
puts the modules with the most tests first), so that the longest ones start first and the
workers finish together. Not ``--dist loadgroup``: with pytest 9.2, pytest-xdist 3.8 can no
longer add a group to a test's node id, and then every test is dealt out on its own, each
worker building every module's fixtures again. Tests of two workers run side by side, so each
fixture has its own home, runs and ports (a Ray head binds none of Ray's fixed defaults).

Skips are counted by cause and printed at the end, one line each. In CI (CI=true) a skip is a
failure, but for the tests marked ``gpu``: CI has no GPU, and everything else is meant to run
there, so a skip means a missing install or a broken fixture, not a green run.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict

import pytest

# The longest modules, longest first (seconds each on the 2-core CI machine, from the suite's
# own --durations report; benchmarks/results/suite-2cpu-*.md says how they were measured).
HEAVY_FIRST = (
    "test_nodes_network", "test_ray", "test_ray_elastic", "test_ray_jobs", "test_cluster_network", "test_examples", "test_notebooks",
    "test_hf_notebooks", "test_example_retinanet", "test_package", "test_hf_examples",
    "test_axolotl", "test_resilience", "test_checkpoint", "test_runs", "test_pool",
    "test_slurm_cluster", "test_typing", "test_docs",
)


# The inner loop (`pytest -m "not slow"`, README): the contract, options and errors, a run of
# the local launcher (kept template and cold) and of a launcher entered in the registry,
# records and the command line; and one run of each other launcher, the tests marked ``inner``
# in their modules (Ray, a local instance; Ray Jobs; nodes, two machines of namespaces; Slurm).
# Every other test is marked slow here.
INNER_LOOP = (
    "test_api", "test_errors", "test_messages", "test_results", "test_launch_seam", "test_precedence",
    "test_cli_input", "test_surface", "test_layering", "test_records_damaged", "test_follow",
)


# Modules whose ranks run DeepSpeed on CPU, and so load its compiled collectives.
DEEPSPEED_MODULES = ("test_deepspeed", "test_example_transformer", "test_hf_examples",
                     "test_hf_notebooks", "test_real_sizes", "test_strategies")


def build_deepspeed_ops() -> None:
    """Compile (or find compiled) DeepSpeed's shared-memory collectives for CPU ranks, into
    TORCH_EXTENSIONS_DIR as the ranks will look for them; nothing where DeepSpeed is absent."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("deepspeed") is None:
        return
    code = "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load()"
    subprocess.run([sys.executable, "-c", code], env={**os.environ, "DS_ACCELERATOR": "cpu"},
                   capture_output=True, timeout=600, check=False)  # a failure shows in the tests


def module_of(item: pytest.Item) -> str:
    return item.module.__name__ if item.module else item.nodeid.split("::")[0]


def order(items: list[pytest.Item]) -> None:
    """Mark slow what is outside the inner loop and put the heaviest modules first (a stable
    sort, so tests keep their order inside a module)."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    for item in items:
        if module_of(item) not in INNER_LOOP and item.get_closest_marker("inner") is None:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: rank.get(module_of(item), len(rank)))


class Skips:
    """Skipped tests, by cause."""

    def __init__(self) -> None:
        self.by_cause: dict[str, list[str]] = defaultdict(list)
        self.gpu: set[str] = set()

    def record(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        if not report.skipped or hasattr(report, "wasxfail"):
            return
        self.by_cause[cause(report)].append(report.nodeid)
        if "gpu" in report.keywords:
            self.gpu.add(report.nodeid)

    def unmeant(self) -> list[str]:
        """In CI, the skipped tests that CI was meant to run: all but the GPU-only ones."""
        if os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
            return []
        return [node for nodes in self.by_cause.values() for node in nodes if node not in self.gpu]

    def summarise(self, write) -> None:
        if not self.by_cause:
            return
        write("")
        write(f"skipped, by cause ({sum(map(len, self.by_cause.values()))} tests):")
        for reason, nodes in sorted(self.by_cause.items(), key=lambda kv: -len(kv[1])):
            kind = "gpu" if all(node in self.gpu for node in nodes) else "SKIPPED"
            write(f"  {kind} x{len(nodes)}: {reason}: {', '.join(short(n) for n in nodes)}")
        if unmeant := self.unmeant():
            write(f"CI meant to run {len(unmeant)} of them: a skip in CI is a failure "
                  "(only tests marked gpu may skip there)")


def cause(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The skip's reason without pytest's "Skipped: " prefix and the file:line before it."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return re.sub(r"^Skipped: ", "", reason).strip().splitlines()[0]


def short(nodeid: str) -> str:
    return nodeid.removeprefix("tests/")


SKIPS = Skips()
