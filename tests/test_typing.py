"""The typed public surface: an editor completes every option of ``@distributed`` and
``.options()``, a type checker catches a misspelled one before anything runs, and takes every
form of a value that the docs teach (``timeout="3m"``, ``gpus="2:4"``, ``"20%"``, ...).

mypy runs in subprocesses, as a user or CI would run it: on gpufleet's own source with the
repository's ``[tool.mypy]`` settings, and on small user files that import the installed
gpufleet (which needs the ``py.typed`` marker). pyright (``npm i -g pyright``) checks the same
user files where it is installed.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import importlib.util
import inspect
import os
import runpy
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpufleet import DistributedFunction, distributed
from gpufleet.options import RunOptions, option_names
from support import REPO, line_of

needs_mypy = pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                                reason="mypy is not installed (pip install -e '.[test]')")
needs_pyright = pytest.mark.skipif(shutil.which("pyright") is None,
                                   reason="pyright is not installed (npm i -g pyright)")


def keyword_only(fn) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY]


def option_defaults() -> dict[str, object]:
    return {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(RunOptions)}


def mypy(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MYPYPATH"}  # gpufleet as installed
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=cwd, env=env,
                          capture_output=True, text=True)


def test_package_says_it_is_typed():
    assert importlib.resources.files("gpufleet").joinpath("py.typed").is_file(), (
        "gpufleet ships without py.typed, so type checkers ignore its annotations"
    )


@pytest.mark.parametrize("fn", [distributed, DistributedFunction.options],
                         ids=["distributed", "options"])
def test_every_option_is_a_typed_keyword(fn):
    params = keyword_only(fn)
    assert [p.name for p in params] == option_names(), f"{fn.__qualname__}'s keyword-only names"
    assert not [p.name for p in params if p.annotation is p.empty], "options without a type"


def test_decorator_defaults_are_the_run_defaults():
    shown = {p.name: p.default for p in keyword_only(distributed)}
    expected = option_defaults()
    wrong = [f"{name}: {repr(shown[name]) if name in shown else 'no such parameter'} "
             f"(RunOptions: {default!r})"
             for name, default in expected.items() if name not in shown or shown[name] != default]
    assert not wrong, "distributed() shows defaults that are not the run's: " + ", ".join(wrong)


@needs_mypy
# The first run without a .mypy_cache reads torch, ray, mlflow, ...: 2 minutes on a busy machine.
@pytest.mark.timeout(600)
def test_mypy_passes_on_the_source():
    result = mypy("src/gpufleet", cwd=REPO)
    if result.returncode:
        pytest.fail(f"mypy src/gpufleet exited {result.returncode}:\n"
                    f"{result.stdout}{result.stderr}")


USER_CODE_OK = """\
from gpufleet import distributed


@distributed(gpus=2)
def train(x: int) -> float:
    return x / 2


results: list[float] = train.distributed(3)
fewer: list[float] = train.options(gpus=1).distributed(3)
"""

USER_CODE_WRONG = """\
from gpufleet import distributed


@distributed(gpu=2)  # misspelled-decorator
def train(x: int) -> float:
    return x / 2


@distributed(gpus=2)
def evaluate(x: int) -> float:
    return x / 2


fewer = evaluate.options(gpu=1)  # misspelled-options
names: list[str] = evaluate.distributed(3)  # wrong-result-type
later = evaluate.options(timeout=["3m"])  # wrong-duration-type
"""

# Every form of a value that docs/options.md, the decorator's docstring and the help texts
# teach, on the decorator and on .options(); each is also accepted when the file runs (no run
# starts: a decorator only checks its options).
USER_CODE_FORMS = """\
import datetime
from pathlib import Path

from gpufleet import GPUType, distributed


def train(x: int) -> float:
    return x / 2


# durations: seconds, text with a unit, a timedelta; none / off where an option can be off
timed = distributed(timeout="3m", hang_timeout="20m", grace_period="30s")(train)
timed = distributed(timeout="90", hang_timeout="1.5h", grace_period=30, placement_timeout="5m")(train)
timed = distributed(timeout="7d", hang_timeout="2h", grace_period=2.5)(train)
timed = distributed(timeout=datetime.timedelta(hours=2), hang_timeout=datetime.timedelta(minutes=20),
                    grace_period=datetime.timedelta(seconds=45))(train)
timed = distributed(timeout=None, hang_timeout="none")(train)
timed = distributed(timeout="off", hang_timeout="off")(train)
# sizes: a number, every GPU, an elastic MIN:MAX on a cluster; machines of a node run
sized = distributed(gpus=2, gpu_type=GPUType.H100)(train)
sized = distributed(gpus=None, gpu_type="A100")(train)
elastic = distributed(gpus="2:4", remote=True, placement="spread", placement_timeout="10m")(train)
elastic = distributed(gpus=(2, 8), remote="ray", pip=["transformers==4.46.0"],
                      runtime_env={"excludes": ["data/"]}, ray_address="http://head:8265")(train)
nodes = distributed(gpus=8, nnodes=2, node_rank=0, rdzv_endpoint="node001:29400", rdzv_id="lm")(train)
nodes = distributed(nnodes="1:4", rdzv_endpoint="node001:29400")(train)
nodes = distributed(nnodes=(1, 4), rdzv_endpoint="node001:29400")(train)
nodes = distributed(nnodes="2", rdzv_endpoint="node001:29400")(train)
# shares: a number or a percentage
shared = distributed(straggler_threshold="20%")(train)
shared = distributed(straggler_threshold=0.2, step_telemetry=True)(train)
# logs: a choice (any case) or ranks
shown = distributed(logs="rank0", collapse_lines=False)(train)
shown = distributed(logs="RANK0")(train)
shown = distributed(logs=[0, 3])(train)
shown = distributed(logs=(1,))(train)
# the rest
other = distributed(env={"HF_HOME": "/data/hf"}, runs_dir=Path("runs"), max_retries=2,
                    no_retry=[ValueError, "mypackage.BadConfig"], show_timings=True, tracking=None,
                    join_mlflow_run=False, name="lm", warm=False, detach=False)(train)
other = distributed(runs_dir="runs", no_retry=ValueError, tracking=True)(train)

# the same on .options()
again = timed.options(timeout="30m", hang_timeout="off", grace_period="1m", straggler_threshold="25%")
again = elastic.options(gpus="2:8", placement_timeout=datetime.timedelta(minutes=3))
again = nodes.options(nnodes="1:2", node_rank=1)
again = shown.options(logs=[1], timeout=90)


def results() -> list[float]:  # typed as a call returns them; not called here
    return again.options(logs="none").distributed(3)
"""

# Only gpufleet's own signatures matter here: the libraries it imports (torch, ray, ...) are
# not read, which keeps a cold run to seconds rather than a minute.
USER_CONFIG = """\
[mypy]
follow_imports = skip
[mypy-gpufleet.*]
follow_imports = silent
"""


@needs_mypy
def test_type_checker_catches_a_misspelled_option(tmp_path):
    for name, text in [("ok.py", USER_CODE_OK), ("wrong.py", USER_CODE_WRONG),
                       ("mypy.ini", USER_CONFIG)]:
        (tmp_path / name).write_text(text)
    result = mypy("--config-file", "mypy.ini", "--cache-dir", str(tmp_path / "cache"),
                  "--show-error-codes", "ok.py", "wrong.py", cwd=tmp_path)
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if ": error:" in line]

    assert not [e for e in errors if e.startswith("ok.py:")], f"correct code rejected:\n{output}"
    missed = []
    for marker, words in [("misspelled-decorator", '"gpu"'), ("misspelled-options", '"gpu"'),
                          ("wrong-result-type", "list[str]"), ("wrong-duration-type", '"timeout"')]:
        line = line_of(tmp_path / "wrong.py", marker)
        if not [e for e in errors if e.startswith(f"wrong.py:{line}:") and words in e]:
            missed.append(f"line {line} ({marker})")
    assert not missed, (f"mypy accepted wrong.py at {', '.join(missed)}:\n"
                        f"{textwrap.indent(USER_CODE_WRONG, '    ')}\nmypy said:\n{output}")


@needs_mypy
def test_mypy_takes_every_documented_form_of_a_value(tmp_path):
    for name, text in [("forms.py", USER_CODE_FORMS), ("mypy.ini", USER_CONFIG)]:
        (tmp_path / name).write_text(text)
    result = mypy("--config-file", "mypy.ini", "--cache-dir", str(tmp_path / "cache"),
                  "--show-error-codes", "forms.py", cwd=tmp_path)
    assert result.returncode == 0, f"mypy refused a documented form:\n{result.stdout}{result.stderr}"


@needs_pyright
def test_pyright_takes_every_documented_form_and_catches_a_misspelled_option(tmp_path):
    for name, text in [("forms.py", USER_CODE_FORMS), ("wrong.py", USER_CODE_WRONG)]:
        (tmp_path / name).write_text(text)
    result = subprocess.run(["pyright", "--pythonpath", sys.executable, "--outputjson", "forms.py",
                             "wrong.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    import json

    found = json.loads(result.stdout)["generalDiagnostics"]
    errors = [(Path(d["file"]).name, d["range"]["start"]["line"] + 1, d["message"])
              for d in found if d["severity"] == "error"]
    assert not [e for e in errors if e[0] == "forms.py"], f"pyright refused a documented form: {errors}"
    for marker in ("misspelled-decorator", "misspelled-options", "wrong-result-type", "wrong-duration-type"):
        line = line_of(tmp_path / "wrong.py", marker)
        assert [e for e in errors if e[:2] == ("wrong.py", line)], f"pyright accepted wrong.py:{line} ({marker})"


def test_every_documented_form_of_a_value_is_accepted_when_it_runs(tmp_path, monkeypatch):
    (tmp_path / "forms.py").write_text(USER_CODE_FORMS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPUFLEET_HOME", str(tmp_path / "home"))
    runpy.run_path(str(tmp_path / "forms.py"))  # a ConfigError names a form the checks refuse
